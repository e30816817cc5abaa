"""FSDP2's default reshard_after_forward=True, FP8 primary weights (gloo, per-layer fully_shard):
the reshard frees the gathered weight and its transpose cache, the backward's all-gather refills
them, and the backward transposes the refilled weight (it reused the freed transpose before: NaN
gradients in 16 parameters). Training equals reshard_after_forward=False bit for bit, and
unsharded data parallel (allreduce_gradients + MasterWeights) where the arithmetic is the same."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graphfp8 as g8
from graphfp8.distributed import allreduce_gradients
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw, lm_loss
from tests.modules.common import fp8_state
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, batch, build_lm

STEPS = 3


def shard_lm(model, reshard: bool):
    """fully_shard per layer (the block, the head), then the root: FSDP2's usual wrapping, where
    reshard_after_forward applies to every layer group but the root's."""
    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for layer in (model.block, model.head):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def train(model, recipe, rank: int, microbatches: int, ddp: bool = False) -> list[torch.Tensor]:
    """STEPS steps of `microbatches` forward/backward each on this rank's data, then the masters'
    step (an FSDP2 model: FSDPMasterWeights; `ddp`: allreduce_gradients and unsharded masters).
    Returns the losses."""
    masters = g8.MasterWeights(model)
    device = next(model.parameters()).device
    opt = adamw(masters.parameters(), device)
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step, device, rank)
        for i in range(microbatches):
            with g8.fp8_autocast(recipe=recipe, fp8_group=dist.group.WORLD):
                out = model(tokens[i], is_first_microbatch=i == 0)
            loss = lm_loss(out, targets[i]) / microbatches
            loss.backward()
            losses.append(loss.detach())
        if ddp:
            allreduce_gradients(model.parameters(), dist.group.WORLD)
        grads = {n: p.grad if ddp else p.grad.full_tensor()
                 for n, p in model.named_parameters() if p.grad is not None}  # fmt: skip
        bad = [n for n, grad in grads.items() if not torch.isfinite(grad).all()]
        assert grads and not bad, f"step {step}: non-finite gradients in {bad}"
        masters.step(opt)
        masters.zero_grad()
    return losses


def _local(model):
    """The model with each FSDP2 parameter replaced by its local shard, for compare_models."""
    return {n: p._local_tensor for n, p in model.named_parameters()}


def _reshard_equals_no_reshard(rank, device, recipe_name):
    recipe = RECIPES[recipe_name]
    runs = {}
    for reshard in (False, True):
        g8.reset_state()
        model = shard_lm(build_lm(device), reshard)
        runs[reshard] = (train(model, recipe, rank, microbatches=2), model)
    (loss_a, a), (loss_b, b) = runs[False], runs[True]
    assert_bitwise_equal(torch.stack(loss_b), torch.stack(loss_a), "losses")
    for (name, pa), (_, pb) in zip(_local(a).items(), _local(b).items(), strict=True):
        if isinstance(pa, g8.Float8Tensor):
            assert_bitwise_equal(pb._data.view(torch.uint8), pa._data.view(torch.uint8), name)
            assert_bitwise_equal(pb._scale_inv, pa._scale_inv, f"{name} scale_inv")
        else:
            assert_bitwise_equal(pb, pa, name)
    for (name, sa), (_, sb) in zip(fp8_state(a), fp8_state(b), strict=True):
        assert_bitwise_equal(sb, sa, name)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_reshard_after_forward_equals_keeping_the_weights(world, recipe_name):
    """Each rank its own data, 2 microbatches per step; 3 ranks shard unevenly."""
    run_on_ranks("gloo", _reshard_equals_no_reshard, recipe_name, world=world)


def _fsdp2_equals_ddp(rank, device, recipe_name):
    recipe = RECIPES[recipe_name]
    ddp = build_lm(device)
    ddp_losses = train(ddp, recipe, rank, microbatches=1, ddp=True)
    g8.reset_state()
    model = shard_lm(build_lm(device), reshard=True)
    losses = train(model, recipe, rank, microbatches=1)
    assert_bitwise_equal(torch.stack(losses), torch.stack(ddp_losses), "losses")
    world = dist.get_world_size()
    for (name, p), (_, q) in zip(ddp.named_parameters(), model.named_parameters(), strict=True):
        local = q._local_tensor
        if isinstance(p, g8.Float8Tensor):
            rows = -(-p.shape[0] // world)
            mine = p._data.view(torch.uint8)[rank * rows : (rank + 1) * rows]
            assert_bitwise_equal(local._data.view(torch.uint8), mine, f"{name} data")
            assert_bitwise_equal(local._scale_inv, p._scale_inv, f"{name} scale_inv")
        else:
            assert_bitwise_equal(q.full_tensor(), p.detach(), name)
    for (name, sa), (_, sb) in zip(fp8_state(ddp), fp8_state(model), strict=True):
        assert_bitwise_equal(sb, sa, name)


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_reshard_after_forward_equals_unsharded_data_parallel(recipe_name):
    """2 ranks, one microbatch per step: FSDP2's reduce-scatter and the all-reduce add the same
    two gradients and halve them (with more microbatches FSDP2 reduces each microbatch's
    gradients and adds the reduced ones, DDP the other way round; 3 ranks divide by 3)."""
    run_on_ranks("gloo", _fsdp2_equals_ddp, recipe_name)
