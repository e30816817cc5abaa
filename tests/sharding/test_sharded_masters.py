"""MasterWeights(model, shard_group=group), eager, on 2 and 3 gloo ranks: equal bit for bit to
unsharded data parallel (allreduce_gradients + an unsharded MasterWeights, the same fused AdamW)
- FP8 weights, high-precision parameters, FP8 scales and losses over several steps, delayed and
current scaling - and holding 1/N of the optimizer state."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from graphfp8.memory import sharded_at, training_state
from graphfp8.testing import assert_bitwise_equal
from tests.rank_pool import run_on_ranks
from tests.sharding.common import (
    RECIPES,
    Sharded,
    Unsharded,
    batch,
    build_lm,
    compare_models,
    state_bytes,
)

STEPS = 3


def _equals_unsharded(rank, device, scaling, same_data, fp8_weights):
    group, recipe = dist.group.WORLD, RECIPES[scaling]
    ref = Unsharded(build_lm(device, fp8_weights), device, group)
    model = build_lm(device, fp8_weights)
    sharded = Sharded(model, device, group)
    compare_models(model, ref.model, f"rank {rank} at construction")
    for s in range(STEPS):
        data = batch(s, device, rank, same_data)
        loss_ref, _ = ref.step(data, recipe)
        loss, _ = sharded.step(data, recipe)
        assert_bitwise_equal(loss, loss_ref, f"rank {rank} step {s}: loss")
        compare_models(model, ref.model, f"rank {rank} step {s}")
    # Each rank holds its slice of the moments: together exactly the unsharded ones.
    mine = torch.tensor([state_bytes(sharded.opt)])
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    assert sum(int(b) for b in every) == state_bytes(ref.opt)
    slices = sum(b.shard for b in sharded.masters.layout.buckets)
    assert int(mine) <= 8 * slices  # 1/N of the masters (padding included), 2 fp32 moments


@pytest.mark.parametrize("scaling", sorted(RECIPES))
def test_two_ranks_equal_unsharded_data_parallel(scaling):
    """Each rank its own data: the reductions of 2 values agree in any order."""
    run_on_ranks("gloo", _equals_unsharded, scaling, False, True)


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8-weights", "fp32-params"])
def test_three_ranks_equal_unsharded_data_parallel(fp8_weights):
    """Uneven slices, the 2-element gain on fewer ranks than all. The same data on every rank:
    three ranks sum three gradients in an order that depends on the buffer (gloo's ring chunks),
    the same order only for equal values."""
    run_on_ranks("gloo", _equals_unsharded, "delayed", True, fp8_weights, world=3)


def _bf16_masters_do_not_depend_on_n(rank, device):
    """bf16 parameters: the sharded masters are fp32 copies (which unsharded training lacks), so
    the reference is the same masters unsharded - each rank its own 1-rank group - on the same
    data (the average of 2 equal bf16 gradients is exact; of 3 it is not)."""
    group = dist.group.WORLD
    alone, _ = dist.new_subgroups(group_size=1)
    ref_model = build_lm(device, True, torch.bfloat16)
    model = copy.deepcopy(ref_model)
    ref = Sharded(ref_model, device, group, shard_group=alone, independent_groups=True)
    sharded = Sharded(model, device, group)
    for s in range(STEPS):
        data = batch(s, device, same_on_all_ranks=True)
        loss_ref, _ = ref.step(data, RECIPES["delayed"])
        loss, _ = sharded.step(data, RECIPES["delayed"])
        assert_bitwise_equal(loss, loss_ref, f"rank {rank} step {s}: loss")
        compare_models(model, ref_model, f"rank {rank} step {s}")
    assert ref.masters.layout.local_numel() > sharded.masters.layout.local_numel()
    # graphfp8.memory.sharded_at: what one rank's state says of 2 ranks, against the 2 ranks.
    at_two = sharded_at(training_state(ref.model, ref.opt, ref.masters), ref.masters, 2)
    mine = training_state(model, sharded.opt, sharded.masters).bytes
    every = [None, None]
    dist.all_gather_object(every, mine)
    for key in ("weights", "grads", "fp32 masters", "master grads"):
        assert at_two.bytes[key] == max(b[key] for b in every), key
    opt = max(b["optimizer state"] for b in every)
    assert abs(at_two.bytes["optimizer state"] - opt) <= 8 * 16, (at_two.bytes, opt)  # the steps


def test_bf16_parameters_shard_the_same_at_any_n():
    run_on_ranks("gloo", _bf16_masters_do_not_depend_on_n)
