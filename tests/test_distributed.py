"""Data parallel FP8 on 2 ranks (tests/rank_pool.py, kept alive between tests): gloo on the CPU
(the replay tape), and, marked `cuda`, NCCL with CUDA graphs on 2 GPUs."""

from __future__ import annotations

import copy
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import graphfp8 as g8
from graphfp8.distributed import (
    DistInfo,
    allreduce_gradients,
    cleanup,
    init_distributed,
    is_distributed,
)
from graphfp8.distributed.data_parallel import _buckets
from graphfp8.graphs import RecordingMode, ReplayTape
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.modules.common import T, build, fp8_state, in_features
from tests.rank_pool import COLLECTIVE_TIMEOUT_S, START_METHOD, WORLD, run_on_ranks

JOIN_TIMEOUT_S = 120  # a torchrun-style run, spawn and imports included

BACKENDS = [
    "gloo",
    pytest.param(
        "nccl",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
        ],
    ),
]


# Launching -------------------------------------------------------------------------------------


def launch(backend: str, worker, *args) -> None:
    """Runs worker(rank, device, *args) on the WORLD ranks of `backend` (tests/rank_pool.py)."""
    run_on_ranks(backend, worker, *args)


def _spawn(entry, args, name: str) -> None:
    ctx = mp.start_processes(entry, args=args, nprocs=WORLD, join=False, start_method=START_METHOD)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: the ranks did not finish in time")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()


# Helpers run inside the ranks ----------------------------------------------------------------


def rank_data(seed: int, shape, device, scale: float = 1.0) -> torch.Tensor:
    """bf16 data that depends only on the seed (generated on the CPU, so every device agrees)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(device)


def assert_same_on_all_ranks(named, what: str) -> None:
    for name, t in named:
        bits = t.detach().contiguous().view(torch.uint8)  # bit patterns, any dtype
        gathered = [torch.empty_like(bits) for _ in range(WORLD)]
        dist.all_gather(gathered, bits)
        for r in range(1, WORLD):
            assert torch.equal(gathered[r], gathered[0]), f"{what}: {name} differs on rank {r}"


def out_features(model) -> int:
    device = next(model.parameters()).device
    with torch.no_grad():
        x = torch.zeros(T, in_features(model), dtype=torch.bfloat16, device=device)
        return model(x).shape[-1]


def synced_state(model) -> list:
    """What data parallelism keeps equal across ranks: weights, grads (after the all-reduce),
    scales and amax histories without row 0, which holds this rank's amaxes of the microbatch
    in flight until the next scale update reduces them."""
    named = list(model.named_parameters())
    grads = [(f"{n}.grad", p.grad) for n, p in named if p.grad is not None]
    fp8 = [(n, t[1:] if n.endswith("history") else t) for n, t in fp8_state(model)]
    return named + grads + fp8


# (a) + (b): eager and graphed data-parallel training ------------------------------------------


def _train_eager_and_graphed(rank, device, kind, steps=3, mbs=3):
    """Eager and graphed copies of one model trained on this rank's data with the amax group and
    the gradient all-reduce: equal bit for bit after every microbatch, and every rank ends with
    the same weights, histories and scales."""
    group = dist.group.WORLD
    recipe = g8.DelayedScaling(amax_history_len=4)
    eager = build(kind, device=device)
    graphed_model = copy.deepcopy(eager)
    k = in_features(eager)
    sample = torch.randn(T, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    graphed = g8.make_graphed_callables(graphed_model, (sample,), fp8_enabled=True,
                                        fp8_recipe=recipe, fp8_weight_caching=True,
                                        fp8_group=group)  # fmt: skip
    ops = graphed.captured_ops()
    assert ops["forward"].count("c10d::allreduce_") == 1
    assert ops["backward"].count("c10d::allreduce_") == 1
    assert not any("allgather" in op for op in ops["forward"] + ops["backward"])  # setup check
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_g = torch.optim.AdamW(graphed_model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        for mb in range(mbs):
            seed = 1000 * rank + 10 * step + mb
            x = rank_data(seed, (T, k), device, 10.0 ** (mb - 1))
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            with g8.fp8_autocast(recipe=recipe, fp8_group=group):
                ye = eager(xe, is_first_microbatch=mb == 0)
            yg = graphed(xg, is_first_microbatch=mb == 0)
            dy = rank_data(seed + 500, tuple(ye.shape), device, 10.0 ** (1 - mb))
            loss_e, loss_g = (ye.float() * dy).sum(), (yg.float() * dy).sum()
            loss_e.backward()
            loss_g.backward()
            what = f"rank {rank} step {step} mb {mb}"
            assert_bitwise_equal(loss_g, loss_e, f"{what}: loss")
            assert_bitwise_equal(xg.grad, xe.grad, f"{what}: dgrad")
            compare_models(eager, graphed_model, what)
            losses.append(loss_e.detach())
        allreduce_gradients(eager.parameters(), group)
        allreduce_gradients(graphed_model.parameters(), group)
        compare_models(eager, graphed_model, f"rank {rank} step {step} after all-reduce")
        assert_same_on_all_ranks(synced_state(eager), f"eager step {step}")
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad()
        opt_g.zero_grad()
    assert_same_on_all_ranks(synced_state(eager), "eager, end")
    assert_same_on_all_ranks(synced_state(graphed_model), "graphed, end")
    # The ranks saw different data: the agreement above is the group's doing.
    gathered = [torch.empty_like(losses[0]) for _ in range(WORLD)]
    dist.all_gather(gathered, losses[0])
    assert not torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["LayerNormMLP", "Stack"])
def test_data_parallel_eager_equals_graphed_and_ranks_agree(backend, kind):
    launch(backend, _train_eager_and_graphed, kind)


# The tape replays the collective, in place and in order ---------------------------------------


def _tape_replays_collective(rank, device):
    t = torch.zeros(1 << 16, device=device)
    tape = ReplayTape()
    with RecordingMode(tape):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        doubled = t * 2
    assert [r.func._schema.name for r in tape.records] == ["c10d::allreduce_", "aten::mul"]
    for value in (3.0, 5.0):
        t.fill_(value + rank)
        if rank == 1:
            time.sleep(0.2)  # rank 0 must wait for rank 1 inside the replay, not race past it
        tape.replay()
        expected = torch.full_like(t, 2 * (value + WORLD - 1))
        assert torch.equal(doubled, expected), f"rank {rank}: the mul read an unreduced tensor"


def test_tape_replays_collective_and_waits_for_it():
    launch("gloo", _tape_replays_collective)


# (c) against single-process runs --------------------------------------------------------------


def _run_microbatch(model, x, dy, recipe, group, graphed=None) -> torch.Tensor:
    if graphed is not None:
        y = graphed(x, is_first_microbatch=None)
    else:
        with g8.fp8_autocast(recipe=recipe, fp8_group=group):
            y = model(x)
    loss = (y.float() * dy).sum()
    loss.backward()
    return loss.detach()


def _same_data_equals_single_process(rank, device, kind):
    """Both ranks feed the same data: the group run (graphed, amax group, averaged grads) equals
    a single-process eager run without a group, bit for bit (max(a, a) = a, (g + g) / 2 = g)."""
    group, recipe = dist.group.WORLD, g8.DelayedScaling(amax_history_len=4)
    single = build(kind, device=device)
    model = copy.deepcopy(single)
    k = in_features(single)
    sample = torch.randn(T, k, dtype=torch.bfloat16, device=device)
    graphed = g8.make_graphed_callables(model, (sample,), fp8_enabled=True, fp8_recipe=recipe,
                                        fp8_group=group)  # fmt: skip
    opt_s = torch.optim.AdamW(single.parameters(), lr=1e-2)
    opt_m = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        for mb in range(2):
            x = rank_data(10 * step + mb, (T, k), device, 10.0 ** (mb - 1))
            dy = rank_data(10 * step + mb + 500, (T, out_features(single)), device)
            loss_s = _run_microbatch(single, x, dy, recipe, None)
            loss_m = _run_microbatch(model, x, dy, recipe, group, graphed)
            assert_bitwise_equal(loss_m, loss_s, f"step {step} mb {mb}: loss")
        allreduce_gradients(model.parameters(), group)
        compare_models(single, model, f"rank {rank} step {step}")
        for opt in (opt_s, opt_m):
            opt.step()
            opt.zero_grad()
    compare_models(single, model, f"rank {rank} end")


def _different_data_reduces_to_the_max(rank, device, kind):
    """Ranks feed different data. Before the first update every rank has the same weights and
    scales, so each amax of the first microbatch depends on this rank's data alone, and the
    amax the group rolls into the history is the max of what single-process runs on each rank's
    data roll in: checked for every slot, forward and backward."""
    group, recipe = dist.group.WORLD, g8.DelayedScaling(amax_history_len=4)
    singles = [build(kind, device=device) for _ in range(WORLD)]
    for s in singles[1:]:
        s.load_state_dict(singles[0].state_dict())
    model = copy.deepcopy(singles[0])
    k = in_features(model)
    xs = [rank_data(r, (T, k), device, 1.0 + 2 * r) for r in range(WORLD)]
    dys = [rank_data(r + 500, (T, out_features(model)), device, 3.0 - 2 * r) for r in range(WORLD)]
    for r, s in enumerate(singles):
        for _ in range(2):  # the second forward's update reduces and rolls the first's amaxes
            _run_microbatch(s, xs[r], dys[r], recipe, None)
    for _ in range(2):
        _run_microbatch(model, xs[rank], dys[rank], recipe, group)
    rolled = [dict(fp8_state(s)) for s in singles]
    for name, history in fp8_state(model):
        if not name.endswith("history"):
            continue
        # The first microbatch's amaxes: rolled in last by the second forward's update, one
        # row earlier in the backward arena, which the second backward has updated again.
        row = -1 if name.endswith("fwd_history") else -2
        local = [h[name][row] for h in rolled]
        assert_bitwise_equal(history[row], torch.maximum(local[0], local[1]), name)
        assert not torch.equal(local[0], local[1]), f"{name}: the test data do not differ"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_group_run_matches_single_process_runs(backend, kind):
    launch(backend, _same_data_equals_single_process, kind)
    launch(backend, _different_data_reduces_to_the_max, kind)


# (d) mismatched FP8 state raises on every rank ----------------------------------------------


def _mismatched_fp8_state_raises(rank, device, case):
    group = dist.group.WORLD
    kind, recipe = "Linear", g8.DelayedScaling(amax_history_len=4)
    if case in ("slots", "eager_slots") and rank == 1:
        kind = "Stack"  # 12 forward slots against Linear's 3
    if case == "recipe" and rank == 1:
        recipe = g8.DelayedScaling(amax_history_len=4, margin=1)
    if case == "reduce_amax" and rank == 1:
        recipe = g8.DelayedScaling(amax_history_len=4, reduce_amax=False)
    model = build(kind, device=device)
    x = torch.randn(T, in_features(model), dtype=torch.bfloat16, device=device)
    expected = {
        "slots": "rank 1 has 12 forward FP8 slots, rank 0 has 3",
        # Eagerly the first forward update sees only the first layer's 3 slots on both ranks;
        # the backward update, at the end of the backward pass, sees all of them.
        "eager_slots": "rank 1 has 4 backward FP8 slots, rank 0 has 1",
        # Eagerly fp8_autocast compares the recipes first (fp8/arena_check.check_recipe_agrees).
        "recipe": "rank 1 has margin=1 in its recipe, rank 0 has margin=0",
        "reduce_amax": "rank 1 has reduce_amax=False in its recipe, rank 0 has reduce_amax=True",
    }[case]
    with pytest.raises(RuntimeError, match=expected):
        if case == "slots":  # graphed: found before warmup
            g8.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=recipe,
                                      fp8_group=group)  # fmt: skip
        else:  # eager: found at the first update
            with g8.fp8_autocast(recipe=recipe, fp8_group=group):
                y = model(x)
            y.float().sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["slots", "eager_slots", "recipe", "reduce_amax"])
def test_mismatched_fp8_state_raises_on_every_rank(backend, case):
    launch(backend, _mismatched_fp8_state_raises, case)


# (e) gradient all-reduce ---------------------------------------------------------------------


def _rank_grads(rank, shapes_dtypes, device) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(77 + rank)
    return [torch.randn(s, generator=gen).to(dt).to(device) for s, dt in shapes_dtypes]


def _allreduce_gradients_averages(rank, device):
    """Two dtypes, a parameter without grad, one listed twice, buckets small enough to split:
    every grad ends as the average (or sum) of the ranks' grads, bit for bit."""
    specs = [((16, 8), torch.float32), ((5,), torch.bfloat16), ((3, 4), torch.float32),
             ((7, 3), torch.bfloat16), ((9,), torch.float32)]  # fmt: skip
    for average in (True, False):
        params = [torch.nn.Parameter(torch.zeros(s, dtype=dt, device=device)) for s, dt in specs]
        no_grad = torch.nn.Parameter(torch.zeros(3, device=device))
        for p, g in zip(params, _rank_grads(rank, specs, device), strict=True):
            p.grad = g
        allreduce_gradients([*params, no_grad, params[0]], bucket_mb=100 / 2**20, average=average)
        per_rank = [_rank_grads(r, specs, device) for r in range(WORLD)]
        for i, p in enumerate(params):
            expected = per_rank[0][i] + per_rank[1][i]
            if average:
                expected = expected / WORLD
            assert_bitwise_equal(p.grad, expected, f"param {i}, average={average}")
        assert no_grad.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_allreduce_gradients_averages(backend):
    launch(backend, _allreduce_gradients_averages)


def test_gradient_buckets_split_by_kind_and_size():
    grads = [torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8),
             torch.zeros(64), torch.zeros(4)]  # fmt: skip
    buckets = _buckets(grads, bucket_bytes=64)
    assert [[tuple(g.shape) + (g.dtype,) for g in b] for b in buckets] == [
        [(8, torch.float32), (8, torch.float32)],
        [(64, torch.float32)],
        [(4, torch.float32)],
        [(8, torch.bfloat16)],
    ]


# init_distributed ------------------------------------------------------------------------------


def _torchrun_entry(rank: int, port: int) -> None:
    """One rank started the way torchrun starts it: only the environment says who it is."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    info = init_distributed("cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    assert info == DistInfo(rank, WORLD, rank, torch.device("cpu"))
    assert init_distributed("cpu") == info  # idempotent
    assert is_distributed() and dist.get_backend() == "gloo"
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == 1.0
    cleanup()
    assert not is_distributed()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_init_distributed_from_torchrun_env():
    _spawn(_torchrun_entry, (_free_port(),), "init_distributed")


def test_init_distributed_without_torchrun_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert init_distributed("cpu") == DistInfo(0, 1, 0, torch.device("cpu"))
    assert not is_distributed()
    with pytest.raises(ValueError, match="device_type"):
        init_distributed("tpu")
