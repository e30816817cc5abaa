"""Sharded masters of blockwise FP8 weights (fp8_model_init(recipe=Float8BlockScaling())) on 2
and 3 gloo ranks: shard boundaries on 128-row stripes, each rank quantizing its own blocks with
no amax all-reduce, equal bit for bit to unsharded data parallel (data, block scales, losses);
the shard checkpoint round-trips; the sharded step graph captures no all-reduce and equals eager."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from graphfp8.distributed import allreduce_gradients
from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.ops import blockwise
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw
from tests.rank_pool import run_on_ranks
from tests.sharding.common import Sharded, Unsharded, compare_models, run_cli

BLOCK = g8.Float8BlockScaling()
MB, T, IN = 2, 32, 144
STEPS = 3


class BlockMLP(nn.Module):
    """Weights of 1 to 4 128-row stripes with partial blocks both ways (N 400, 272, 144; K 144,
    400, 272), a bias, and a 2-element gain smaller than the ranks."""

    def __init__(self, device):
        super().__init__()
        kw = dict(params_dtype=torch.float32, device=device)
        self.a = g8.Linear(IN, 400, **kw)
        self.b = g8.Linear(400, 272, bias=False, **kw)
        self.c = g8.Linear(272, IN, bias=False, **kw)
        self.gain = nn.Parameter(torch.tensor([1.0, 1.2], device=device))

    def forward(self, x, is_first_microbatch=None):
        h = F.gelu(self.a(x, is_first_microbatch=is_first_microbatch))
        h = F.gelu(self.b(h, is_first_microbatch=is_first_microbatch))
        return self.c(h, is_first_microbatch=is_first_microbatch) * self.gain.mean()


def _build(device, power_2_scale: bool = True) -> BlockMLP:
    torch.manual_seed(0)
    with g8.fp8_model_init(recipe=g8.Float8BlockScaling(power_2_scale=power_2_scale)):
        return BlockMLP(device)


def mse(y, target):
    return (y - target).square().mean()


def _inputs(step: int, rank: int, device) -> torch.Tensor:
    """Step `step`'s MB microbatches x (T, IN) of `rank` (0: the same on every rank)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MB, T, IN, generator=gen).to(device)


def _one_step(side, xs: torch.Tensor, recipe) -> torch.Tensor:
    """MB microbatches (loss mse(y, x)), the reduction, the masters' step. Returns the loss."""
    total = torch.zeros(())
    for i in range(MB):
        with g8.fp8_autocast(recipe=recipe):
            y = side.model(xs[i], is_first_microbatch=i == 0)
        loss = mse(y, xs[i]) / MB
        loss.backward()
        total += loss.detach().cpu()
    if isinstance(side, Unsharded):
        allreduce_gradients(side.model.parameters(), side.group)
    side.masters.step(side.opt)
    side.masters.zero_grad()
    return total


def _steps(side, device, rank, same_data: bool, recipe, steps: int = STEPS) -> list:
    """`steps` steps (_one_step); the losses."""
    return [_one_step(side, _inputs(s, 0 if same_data else rank, device), recipe)
            for s in range(steps)]  # fmt: skip


class _MaxReduces:
    """Counts MAX all-reduces (an amax all-reduce) while active."""

    def __enter__(self):
        self.count, self.real = 0, dist.all_reduce

        def counting(t, op=dist.ReduceOp.SUM, *args, **kwargs):
            self.count += op == dist.ReduceOp.MAX
            return self.real(t, op, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def _equals_unsharded(rank, device, same_data: bool, power_2_scale: bool):
    group = dist.group.WORLD
    recipe = g8.Float8BlockScaling(power_2_scale=power_2_scale)
    ref = Unsharded(_build(device, power_2_scale), device, group)
    model = _build(device, power_2_scale)
    with _MaxReduces() as reduces:
        sharded = Sharded(model, device, group)
        compare_models(model, ref.model, f"rank {rank} at construction")
        blockwise = [b for b in sharded.masters.layout.buckets if b.stripe]
        assert {b.stripe for b in blockwise} == {128 * IN, 128 * 400, 128 * 272}
        for b in blockwise:  # every entry and every rank's slice on whole 128-row stripes
            assert b.shard % b.stripe == 0 and all(e.offset % b.stripe == 0 for e in b.entries)
        for piece in sharded.masters.layout.pieces:
            if isinstance(model.get_parameter(piece.entry.name), Float8BlockTensor):
                assert (piece.start - piece.entry.offset) % (128 * piece.entry.shape[1]) == 0
        losses = _steps(sharded, device, rank, same_data, recipe)
    assert reduces.count == 0, f"rank {rank}: {reduces.count} amax all-reduces"
    ref_losses = _steps(ref, device, rank, same_data, recipe)
    for s, (loss, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert_bitwise_equal(loss, want, f"rank {rank} step {s}: loss")
    compare_models(model, ref.model, f"rank {rank} after {STEPS} steps")
    for name, p in model.named_parameters():
        if isinstance(p, Float8BlockTensor):  # the block scales are views of the gathered buffer
            assert p._scale_inv.shape == (-(-p.shape[0] // 128), -(-p.shape[1] // 128)), name


@pytest.mark.parametrize("power_2_scale", [True, False])
def test_two_ranks_equal_unsharded_data_parallel(power_2_scale):
    """Each rank its own data: the reductions of 2 values agree in any order."""
    run_on_ranks("gloo", _equals_unsharded, False, power_2_scale)


def test_three_ranks_equal_unsharded_data_parallel():
    """Uneven slices (a 4-stripe weight over 3 ranks, a rank holding no stripe of a 2-stripe
    one); the same data on every rank (3 equal gradients sum alike in any order)."""
    run_on_ranks("gloo", _equals_unsharded, True, True, world=3)


def _loads_float32_scale_blocks(rank, device):
    group = dist.group.WORLD
    recipe = g8.Float8BlockScaling(power_2_scale=False)
    checkpoint = _build(device, power_2_scale=False).state_dict()
    ref, model = Unsharded(_build(device), device, group), _build(device)
    sharded = Sharded(model, device, group)
    for side in (ref, sharded):  # after building the masters: adopted at the next step
        side.model.load_state_dict(checkpoint)
    losses = _steps(sharded, device, rank, False, recipe, steps=2)
    ref_losses = _steps(ref, device, rank, False, recipe, steps=2)
    for s, (loss, want) in enumerate(zip(losses, ref_losses, strict=True)):
        assert_bitwise_equal(loss, want, f"rank {rank} step {s}: loss")
    compare_models(model, ref.model, f"rank {rank} after 2 steps")


def test_blocks_of_float32_scales_loaded_into_a_sharded_model():
    """Issue 42: a checkpoint's float32-scale blocks loaded into a power-of-2 model make its
    weights float32-scale ones (copy_ brings the setting); the sharded write-back kept
    quantizing with the setting of construction (power-of-2 blocks under a weight saying
    otherwise), the unsharded one did not: now both equal bit for bit."""
    run_on_ranks("gloo", _loads_float32_scale_blocks)


def _checkpoint_round_trip(rank, device):
    group = dist.group.WORLD
    model = _build(device)
    sharded = Sharded(model, device, group)
    _steps(sharded, device, rank, False, BLOCK, steps=1)
    state = sharded.masters.state_dict()
    other = _build(device)
    again = Sharded(other, device, group)
    again.masters.load_state_dict(state)
    compare_models(other, model, f"rank {rank} loaded")
    full = sharded.masters.full_state_dict()
    if rank == 0:
        unsharded = g8.MasterWeights(_build(device))
        unsharded.load_state_dict({"masters": full["masters"]})
        for n, p in zip(unsharded.names, unsharded.fp8_params, strict=True):
            mine = model.get_parameter(n)
            assert_bitwise_equal(p._data.view(torch.uint8), mine._data.view(torch.uint8), n)
            assert_bitwise_equal(p._scale_inv, mine._scale_inv, f"{n} scale_inv")


def test_shard_checkpoint_and_full_masters_round_trip():
    run_on_ranks("gloo", _checkpoint_round_trip, world=3)


@contextlib.contextmanager
def _gemm_path():
    """On CUDA the emulated blockwise GEMM unless GRAPHFP8_BLOCKWISE_GEMM chose one (a rank
    process outlives the test: put back)."""
    saved = blockwise.GEMM_MODE
    blockwise.GEMM_MODE = saved or "emulate"
    try:
        yield
    finally:
        blockwise.GEMM_MODE = saved


def _step_graph_equals_eager(rank, device):
    """The whole sharded step as one graph (the CPU tape on gloo, a CUDA graph with NCCL): the
    blockwise write-back is captured with no all-reduce at all (no clipping here), and equals
    the eager step."""
    with _gemm_path():
        _step_graph_body(rank, device)


def _step_graph_body(rank, device):
    group = dist.group.WORLD
    eager = Sharded(_build(device), device, group)
    model = _build(device)
    masters = g8.MasterWeights(model, shard_group=group)
    opt = adamw(masters.parameters(), device)
    sample = torch.randn(MB, T, IN, device=device)
    step = g8.make_graphed_step(model, mse, opt, (sample, sample), MB, fp8_enabled=True,
                                fp8_recipe=BLOCK, master_weights=masters,
                                num_warmup_iters=1)  # fmt: skip
    ops = step.captured_ops()
    assert "c10d::allreduce_" not in ops, "an all-reduce in the blockwise sharded step"
    blockwise = sum(1 for b in masters.layout.buckets if b.stripe)
    assert ops.count("c10d::_allgather_base_") == len(masters.layout.buckets) + blockwise
    for s in range(STEPS):
        xs = _inputs(s, rank, device)
        loss = _one_step(eager, xs, BLOCK)
        assert_bitwise_equal(step((xs, xs)).cpu(), loss, f"rank {rank} step {s}: loss")
        compare_models(model, eager.model, f"rank {rank} step {s}")


def test_sharded_step_graph_equals_eager():
    run_on_ranks("gloo", _step_graph_equals_eager)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sharded_step_graph_equals_eager_with_nccl():
    """One H200 (NCCL, world 1): the captured step holds no all-reduce."""
    run_on_ranks("nccl", _step_graph_equals_eager, world=1)


def _cli_runs(rank, device, tmp):
    """graphfp8-train --ddp --shard --fp8-weights --scaling blockwise, eager and as one step
    graph, on 3 ranks: the same losses, the ranks agree."""
    args = ["--device", "cpu", "--ddp", "--shard", "--fp8-weights", "--scaling", "blockwise",
            "--batch", "2", "--seq-len", "32", "--microbatches", "2", "--data", "synthetic",
            "--val-batches", "1", "--log-every", "1", "--steps", "2"]  # fmt: skip
    losses = {}
    for mode in ("none", "step"):
        code, _, err = run_cli([*args, "--graphs", mode, "--out", f"{tmp}/{mode}"])
        assert code == 0, err
        if rank == 0:  # rank 0 writes the summary
            run = json.loads((Path(tmp) / mode / "summary.json").read_text())["runs"][0]
            assert run["name"].startswith("fp8-block-fp8w-") and run["name"].endswith("-shard")
            assert run["ranks_agree"]["parameters"] is True
            losses[mode] = run["losses"]
    assert rank != 0 or losses["none"] == losses["step"], losses


def test_graphfp8_train_shards_blockwise_fp8_weights(tmp_path):
    run_on_ranks("gloo", _cli_runs, str(tmp_path), world=3)
