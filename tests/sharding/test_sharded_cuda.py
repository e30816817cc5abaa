"""Sharded masters with NCCL (tests/rank_pool.py, one GPU per rank): on one GPU (the H200 run of
issue 31, `GPU_STEPS=shard`) the whole sharded step captured in a CUDA graph - the NCCL
reduce-scatter, the norm's all-reduce, the amax all-reduce and the all-gathers as graph nodes -
equal bit for bit to the eager sharded step, and sharding at N=1 equal to unsharded
MasterWeights; on 2 and more GPUs (issue 34, `GPU_STEPS=scaling`; skipped with fewer) the same
at N = 2, 3 and every GPU of the machine (uneven slices at 3), and at N=2, each rank its own data,
sharded equal to unsharded data parallel bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, Sharded, Unsharded, batch, build_lm, compare_models
from tests.sharding.test_sharded_idioms import (
    _load_after_masters,
    _refusals,
    _zero_grad_by_optimizer,
)
from tests.sharding.test_sharded_step_graph import _graphed_equals_eager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("scaling", sorted(RECIPES))
def test_sharded_step_graph_equals_eager_with_nccl(scaling):
    run_on_ranks("nccl", _graphed_equals_eager, scaling, world=1)


def _one_rank_equals_unsharded(rank, device):
    """One AdamW implementation on both sides (torch picks foreach for plain CUDA tensors and
    the for-loop for the masters' subclasses: 1 ulp apart on the H200)."""
    group, recipe = dist.group.WORLD, RECIPES["delayed"]
    ref = Unsharded(build_lm(device), device, group, foreach=False)
    model = build_lm(device)
    sharded = Sharded(model, device, group, optimizer_kw={"foreach": False})
    for s in range(3):
        data = batch(s, device)
        ref.step(data, recipe)
        sharded.step(data, recipe)
        compare_models(model, ref.model, f"step {s}")


def test_one_rank_of_nccl_equals_unsharded():
    run_on_ranks("nccl", _one_rank_equals_unsharded, world=1)


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = sorted({w for w in (2, 3, GPUS) if 2 <= w <= GPUS}) or [2]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("world", WORLDS)
def test_sharded_step_graph_equals_eager_on_several_gpus(world):
    run_on_ranks("nccl", _graphed_equals_eager, "delayed", world=world)


def _two_ranks_equal_unsharded(rank, device):
    """Each rank its own data: NCCL's all-reduce and reduce-scatter of 2 values both add a + b."""
    group, recipe = dist.group.WORLD, RECIPES["current"]
    ref = Unsharded(build_lm(device), device, group, foreach=False)
    model = build_lm(device)
    sharded = Sharded(model, device, group, optimizer_kw={"foreach": False})
    for s in range(3):
        data = batch(s, device, rank)
        ref.step(data, recipe)
        sharded.step(data, recipe)
        compare_models(model, ref.model, f"rank {rank} step {s}")


@pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")
def test_two_gpus_equal_unsharded_data_parallel():
    run_on_ranks("nccl", _two_ranks_equal_unsharded, world=2)


def test_idioms_with_nccl():
    """Issue 40's rows on one GPU (tests/sharding/test_sharded_idioms.py): the refusals (the
    gradient watch on CUDA accumulators), opt.zero_grad() and a load after the masters (the model
    watch's byte comparison on the GPU), equal to unsharded (one AdamW implementation)."""
    run_on_ranks("nccl", _refusals, world=1)
    run_on_ranks("nccl", _zero_grad_by_optimizer, True, True, {"foreach": False}, world=1)
    run_on_ranks("nccl", _load_after_masters, True, {"foreach": False}, world=1)
