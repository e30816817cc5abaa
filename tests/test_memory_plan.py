"""The memory planner (graphfp8.memory.plan) against measured allocations on the CPU: the
persistent state by category (graphfp8.memory.training_state in the optimizer step, as
benchmarks/memory_shard.py takes it; N = 2 from the sharded layout, graphfp8.memory.sharded_at), the
activations one microbatch keeps and its peak (graphfp8.memory.LiveBytes) for each recompute
mode, and the peak of whole graphfp8-train runs in each graph mode (benchmarks.memory_plan's
cpu_peak: the graphs allocating as CUDA graphs do), within 10% (the state is exact up to
scale_invs and step counts)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from benchmarks.memory_plan import _tokens, cpu_peak, fresh_sharding_propagation
from benchmarks.memory_shard import one_rank_group, state_in_optimizer_step
from graphfp8.memory import LiveBytes, sharded_at
from graphfp8.memory.plan import largest_fit, main, plan
from graphfp8.memory.shapes import LLAMA, shape_from, shape_of
from graphfp8.training.model import GPT, PRESETS
from graphfp8.training.run import RunSpec
from tests.rank_pool import run_on_ranks

B, S = 2, 32
RECIPE = g8.DelayedScaling(amax_history_len=4)


def _model(preset: str, fp8_weights: bool = False, vocab: int | None = None):
    cfg = dataclasses.replace(PRESETS[preset], batch=B, seq_len=S)
    cfg = cfg if vocab is None else dataclasses.replace(cfg, vocab=vocab)
    g8.reset_state()
    torch.manual_seed(0)
    with g8.fp8_model_init(enabled=fp8_weights):
        return GPT(cfg, torch.bfloat16, "cpu"), cfg


def _state_in_optimizer_step(preset: str, fp8_weights: bool, group):
    """graphfp8-train's model, masters and AdamW after one step and a second microbatch whose
    gradients reached the masters (everything of the optimizer step alive)."""
    model, cfg = _model(preset, fp8_weights)
    tokens = torch.randint(0, cfg.vocab, (B, S), generator=torch.Generator().manual_seed(0))

    def forward_backward(model):
        with g8.fp8_autocast(recipe=RECIPE):
            model(tokens, tokens, is_first_microbatch=True).backward()

    return state_in_optimizer_step(model, forward_backward, fp8_weights, group)


def _close(got: float, want: float, tol: float, what: str) -> None:
    assert abs(got - want) <= tol * want, f"{what}: planned {got}, measured {want}"


@pytest.mark.parametrize("fp8_weights", [False, True])
@pytest.mark.parametrize("sharding", ["ddp", "zero2"])
@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_planned_state_matches_measured(preset, sharding, fp8_weights):
    with one_rank_group(torch.device("cpu")) as group:
        sharded = group if sharding == "zero2" else None
        state, masters = _state_in_optimizer_step(preset, fp8_weights, sharded)
        worlds = {1: state}
        if sharding == "zero2":
            worlds[2] = sharded_at(state, masters, 2)
    for n, measured in worlds.items():
        p = plan(shape_from(PRESETS[preset]), n=n, seq=S, batch=B, sharding=sharding,
                 fp8_weights=fp8_weights, graphs="none")  # fmt: skip
        got, want = p.bytes, measured.bytes
        what = f"{preset} {sharding} N={n} FP8 weights {fp8_weights}"
        _close(got["weights"], want["weights"], 0.01, f"{what}: weights")
        _close(got["FP8 caches"], want["FP8 weight casts"], 0.01, f"{what}: FP8 caches")
        _close(got["optimizer state"], want["optimizer state"], 0.01, f"{what}: optimizer")
        if sharding == "zero2":
            _close(got["masters"], want["fp32 masters"] + want["master grads"], 0.01, what)
            _close(got["gradients"], want["grads"], 0.01, f"{what}: grads")
        # unsharded FP8 weights: their bf16 gradients became the masters' fp32 ones
        _close(p.state + p.optimizer_transient, measured.total, 0.01, f"{what}: total")


@pytest.mark.parametrize("vocab", [256, 16])  # the loss's working set dominates, or a layer's
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_planned_activations_and_peak_match_measured(preset, recompute, vocab):
    model, cfg = _model(preset, vocab=vocab)
    for layer in model.blocks.layers:
        layer.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, vocab, (B, S), generator=gen) for _ in range(2))
    with g8.fp8_autocast(recipe=RECIPE):  # FP8 state, weight casts and .grad exist already
        model(tokens, targets).backward()
    with LiveBytes() as live:
        with g8.fp8_autocast(recipe=RECIPE):
            loss = model(tokens, targets, is_first_microbatch=False)
        kept = live.live - loss.untyped_storage().nbytes()
        loss.backward()
    shape = shape_from(PRESETS[preset], vocab=vocab)
    p = plan(shape, seq=S, batch=B, recompute=recompute, graphs="none")
    what = f"{preset} recompute {recompute} vocab {vocab}"
    _close(p.bytes["activations"], kept, 0.1, f"{what}: activations")
    _close(p.bytes["activations"] + p.bytes["working set"], live.peak, 0.1, f"{what}: peak")


def test_step_graph_holds_no_copy_of_the_model():
    """The step graph's capture keeps its undo copy in host memory (graphs/step_optim.py): at N=1
    it fits as deep a model as the eager loop less the fp32 master gradients it keeps (before:
    5.0B parameters, a copy of the weights and masters on the GPU; the issue's target: 6B)."""
    kw = dict(seq=8192, batch=1, recompute="full", fp8_weights=True)
    step, eager = (largest_fit("llama-8b", 1, graphs=g, **kw) for g in ("step", "none"))
    assert step.parameters >= 6e9 and step.fits()
    p = plan("llama-8b", graphs="step", **kw)
    q = plan("llama-8b", graphs="none", **kw)
    assert p.state == q.state + 4 * 32 * shape_of("llama-8b").fp8_layer_params()
    assert p.bytes["graph pools"] == 0 and step.parameters < eager.parameters


def test_llama_shapes_and_planner_outputs(capsys):
    assert round(shape_of("llama-8b").parameters() / 1e9, 2) == 8.03
    assert round(LLAMA["llama-1b"].parameters() / 1e9, 2) == 1.24
    assert round(LLAMA["llama-70b"].parameters() / 1e9, 1) == 70.6
    kw = dict(seq=8192, batch=1, recompute="full", fp8_weights=True)
    one, eight = largest_fit("llama-8b", 1, sharding="fsdp2", **kw), largest_fit(
        "llama-8b", 8, sharding="fsdp2", **kw)  # fmt: skip
    assert one.parameters < eight.parameters and one.fits() and eight.fits()
    full, none = (plan("llama-8b", **{**kw, "recompute": r}) for r in ("full", "none"))
    assert full.bytes["activations"] <= none.bytes["activations"] / 4
    assert main(["--preset", "llama-8b", "--n", "8", "--sharding", "fsdp2", "--recompute",
                 "full", "--fp8-weights", "--fit"]) == 0  # fmt: skip
    assert "largest that fits" in capsys.readouterr().out
    with pytest.raises(ValueError, match="sharding must be one of"):
        plan("llama-8b", sharding="zero3")


# Llama-3-8B's proportions at 1/64 of its width (vocabulary ~31 H, T = 2 H): the H200 rows of
# `python -m benchmarks memory-plan` (profiles/h200-2026-12-01-s6) at CPU size.
RUN_CONFIG = dataclasses.replace(PRESETS["llama-tiny"], hidden=64, heads=2, kv_heads=1, ffn=224,
                                 vocab=2004, batch=1, seq_len=128)  # fmt: skip


@pytest.fixture(scope="module")
def run_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan_runs")
    return _tokens(tmp, RUN_CONFIG.vocab, 64 * RUN_CONFIG.seq_len), tmp


# (FP8 weights, recompute, graphs, sharding): the H200 rows, a bf16 step graph, FP8-weight layer
# graphs and sharded masters at N = 1. The step graph's rows were 0.81-0.89 of measured before
# the capture's copy of the weights and masters and the graph's persistent master gradients were
# planned (H200: 0.778), 1.10-1.18 once that copy moved to host memory and was dropped after the
# capture (the planner still counting it), the FP8-weight layer graphs' 1.11 before replays
# stopped counting the
# pool's activations (H200, bf16 weights: 1.132), zero2's 0.93-0.94 before the sharded masters'
# copy of the rank's weights (ModelWatch).
@pytest.mark.parametrize("fp8_weights,recompute,graphs,sharding", [
    (False, "none", "layers", "ddp"), (False, "full", "layers", "ddp"),
    (True, "selective", "step", "ddp"), (True, "full", "none", "ddp"),
    (False, "none", "step", "ddp"), (True, "selective", "layers", "ddp"),
    (True, "full", "none", "zero2"), (False, "selective", "step", "zero2"),
])  # fmt: skip
def test_planned_peak_matches_whole_runs(run_data, fp8_weights, recompute, graphs, sharding):
    data, tmp = run_data
    shard = sharding == "zero2"
    spec = RunSpec("plan", RUN_CONFIG, "fp8", graphs, microbatches=2, device="cpu",
                   fp8_weights=fp8_weights, recompute=recompute, shard=shard)  # fmt: skip
    with one_rank_group(torch.device("cpu")) as group:
        measured = cpu_peak(spec, data, tmp, steps=2, group=group if shard else None)
    p = plan(shape_from(RUN_CONFIG), seq=RUN_CONFIG.seq_len, batch=1, recompute=recompute,
             fp8_weights=fp8_weights, graphs=graphs, sharding=sharding)  # fmt: skip
    what = f"{sharding} FP8 weights {fp8_weights} recompute {recompute} {graphs}"
    _close(p.peak, measured, 0.1, what)
    assert p.footprint >= p.peak


# The vocabulary at the width (64): the eager validation pass that graphfp8-train runs at the end
# is the peak with per-layer graphs (one layer's forward, its weights cast anew, beside the state
# and the graphs' buffers, whose activations live in the pool), or with 6 layers the capture (the
# blocks' persistent gradient buffers beside their activations). Before they were planned: 0.81
# and 0.82 (bf16 weights), 0.95 (FP8 weights), 0.78 with 6 layers (the CPU capture's copy of the
# gradient buffers counted, which a GPU does not hold: graphs/grads.py).
@pytest.mark.parametrize("fp8_weights,recompute,graphs,layers", [
    (False, "none", "layers", 2), (False, "full", "layers", 2), (True, "selective", "layers", 2),
    (False, "none", "none", 2), (True, "full", "step", 2), (False, "none", "layers", 6),
])  # fmt: skip
def test_planned_peak_with_a_small_vocabulary(tmp_path, fp8_weights, recompute, graphs, layers):
    cfg = dataclasses.replace(RUN_CONFIG, vocab=64, layers=layers)
    spec = RunSpec("plan", cfg, "fp8", graphs, microbatches=2, device="cpu",
                   fp8_weights=fp8_weights, recompute=recompute)  # fmt: skip
    measured = cpu_peak(spec, _tokens(tmp_path, cfg.vocab, 64 * cfg.seq_len), tmp_path, steps=2)
    p = plan(shape_from(cfg), seq=cfg.seq_len, batch=1, recompute=recompute,
             fp8_weights=fp8_weights, graphs=graphs)  # fmt: skip
    what = f"V 64 {layers} layers FP8 weights {fp8_weights} recompute {recompute} {graphs}"
    _close(p.peak, measured, 0.1, what)
    assert p.footprint >= p.peak


def _fsdp_plan_worker(rank, device, fp8_weights, recompute, vocab, hidden):
    """graphfp8-train --fsdp on this rank (bf16 or FP8 weights, a recompute mode; FSDP2's default
    reshard_after_forward), its peak allocated bytes against the plan for the world's N, from
    empty sharding-propagation caches, as a fresh run (its first fused AdamW step over DTensors
    propagates their shardings anew: docs/sharding.md, "The first optimizer step under FSDP2")."""
    cfg = dataclasses.replace(RUN_CONFIG, vocab=vocab, hidden=hidden)
    n = dist.get_world_size() if dist.is_initialized() else 1
    spec = RunSpec("plan", cfg, "fp8", "none", microbatches=2, device="cpu",
                   fp8_weights=fp8_weights, recompute=recompute, fsdp=True)  # fmt: skip
    fresh_sharding_propagation()
    with tempfile.TemporaryDirectory() as tmp:
        data = _tokens(Path(tmp), cfg.vocab, 64 * cfg.seq_len)
        with one_rank_group(torch.device("cpu")) if n == 1 else _world() as group:
            measured = cpu_peak(spec, data, Path(tmp), steps=2, group=group)
    p = plan(shape_from(cfg), n=n, seq=cfg.seq_len, batch=1, recompute=recompute,
             fp8_weights=fp8_weights, graphs="none", sharding="fsdp2")  # fmt: skip
    what = f"fsdp2 N={n} rank {rank} FP8 weights {fp8_weights} recompute {recompute} V {vocab}"
    _close(p.peak, measured, 0.1, f"{what} H {hidden}")


class _world:
    """The rank pool's whole group, as one_rank_group hands one."""

    def __enter__(self):
        return dist.group.WORLD

    def __exit__(self, *exc) -> None:
        return None


# graphfp8-train --fsdp measured with AllocatedBytes (DTensors' local shards, FSDP2's all-gather
# and reduce-scatter buffers, its unsharded parameters while gathered). The planner before:
# 1.32-1.34 with FP8 weights at N = 1 (every parameter planned an fp32 master and AdamW state;
# the roots' gathered weights not planned), 0.86-0.89 with vocabulary 16 at N = 2 and 3 before
# the first step's fused AdamW transient (its learning rate a tensor: DTensor's fake-tensor
# fallback at the global shapes) was planned, and 1.30 with FP8 weights, full recompute and
# vocabulary 2004 (the transient planned as one, it came per dtype group, one group at a time)
# until the transient was removed (graphfp8/distributed/optimizer_meta.py).
@pytest.mark.parametrize("fp8_weights,recompute,vocab,hidden", [
    (True, "none", 2004, 64), (False, "selective", 2004, 80),
    (True, "full", 2004, 96),
    (False, "none", 2004, 112), (True, "full", 16, 128), (False, "none", 16, 144),
])  # fmt: skip
def test_planned_fsdp2_peak_matches_one_rank(fp8_weights, recompute, vocab, hidden):
    _fsdp_plan_worker(0, torch.device("cpu"), fp8_weights, recompute, vocab, hidden)


# bf16 parameters with full recompute at N = 2 and 3 measured up to 1.13 of plan now and then (6.79
# MB against 6.04 at N = 2; a non-strict xfail until then), in fresh ranks and used ones:
# AllocatedBytes counted the collectives' buffers that gloo's worker threads free (FSDP2's
# all-gather output of the head, gloo's copy of a reduce-scatter's input: 320640 bytes each) until
# their address was allocated again, so the count hung on the threads' timing. It now takes every
# free when it happens, on whichever thread (c10's process-wide count:
# tests/test_memory_allocated.py): 0.984-0.986 of plan in 72 of 75 rank runs, 0.93-0.94 in 3 where
# gloo's thread freed the head's all-gather output only after the loss's backward (its real life).
@pytest.mark.parametrize("world,fp8_weights,recompute,vocab,hidden", [
    (2, True, "none", 2004, 64), (2, False, "full", 2004, 80), (2, True, "selective", 16, 96),
    (3, True, "none", 2004, 64), (3, False, "full", 2004, 80), (3, True, "selective", 16, 96),
])  # fmt: skip
def test_planned_fsdp2_peak_matches_each_rank(world, fp8_weights, recompute, vocab, hidden):
    run_on_ranks("gloo", _fsdp_plan_worker, fp8_weights, recompute, vocab, hidden, world=world)
