"""DDP idioms with sharded masters (issue 40's silent rows, gloo ranks): each does what it does
under DDP (bit for bit against unsharded data parallel) or raises before any state changes,
naming the fix - torch's clip of the model's unreduced gradients, opt.zero_grad(), a backward
after masters.clip_grad_norm_, nanoGPT's `p.ndim < 2` param groups, shape-aware optimizers,
model.load_state_dict after the masters, a shard group smaller than the world, shard_group=None,
and full_state_dict with a frozen FP8 layer (docs/sharding.md, "Idioms")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.distributed import ShardedMasterWeights
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw
from tests.rank_pool import run_on_ranks
from tests.sharding.common import (
    RECIPES,
    GainLM,
    Sharded,
    Unsharded,
    batch,
    build_lm,
    compare_models,
    microbatches,
)
from tests.sharding.test_sharded_misuse import _snapshot, _unchanged

STEPS = 3


def _zero_grad_by_optimizer(rank, device, set_to_none, same_data, optimizer_kw=None):
    """opt.zero_grad() in place of masters.zero_grad(): the model's gradients cleared, as DDP."""
    group, recipe, kw = dist.group.WORLD, RECIPES["delayed"], optimizer_kw or {}
    ref = Unsharded(build_lm(device), device, group, **kw)
    run = Sharded(build_lm(device), device, group, optimizer_kw=kw)
    for s in range(STEPS):
        data = batch(s, device, rank, same_data)
        ref.step(data, recipe)
        microbatches(run.model, data, group, recipe)
        run.masters.step(run.opt)
        run.opt.zero_grad(set_to_none=set_to_none)
        compare_models(run.model, ref.model, f"rank {rank} step {s}")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_optimizer_zero_grad_clears_the_model_gradients(set_to_none):
    run_on_ranks("gloo", _zero_grad_by_optimizer, set_to_none, False)


def test_optimizer_zero_grad_on_three_ranks():
    """A rank that holds no piece of `gain` clears its gradient too."""
    run_on_ranks("gloo", _zero_grad_by_optimizer, True, True, world=3)


def _refusals(rank, device):
    """torch's clip of the model's unreduced gradients; a backward after masters' clip; groups
    filtered by the pieces' ndim; Adafactor: each raises, nothing changed; then a correct step."""
    group, recipe = dist.group.WORLD, RECIPES["delayed"]
    run = Sharded(build_lm(device), device, group)
    data = batch(0, device, rank)
    microbatches(run.model, data, group, recipe)
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 0.05)
    before = _snapshot(run)
    with pytest.raises(RuntimeError, match=r"changed in place after the backward.*masters\.clip"):
        run.masters.step(run.opt)
    _unchanged(run, before, "torch's clip of the model's gradients")
    run.masters.zero_grad()
    microbatches(run.model, data, group, recipe)
    run.masters.clip_grad_norm_(1.0)
    microbatches(run.model, data, group, recipe)
    before = _snapshot(run)
    with pytest.raises(RuntimeError, match="a backward ran after the gradients were reduced"):
        run.masters.step(run.opt)
    _unchanged(run, before, "a backward after clip_grad_norm_")
    pieces = run.masters.parameters()
    by_ndim = [{"params": [p for p in pieces if p.ndim >= 2], "weight_decay": 0.1},
               {"params": [p for p in pieces if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    with pytest.raises(ValueError, match=r"param groups \[0\] hold no master.*param_groups"):
        run.masters.step(adamw(by_ndim, device))
    _unchanged(run, before, "groups by the pieces' ndim")
    with pytest.raises(TypeError, match="Adafactor is not an elementwise optimizer"):
        run.masters.step(torch.optim.Adafactor(pieces))
    _unchanged(run, before, "Adafactor")
    run.masters.zero_grad()
    microbatches(run.model, data, group, recipe)
    run.masters.step(torch.optim.SGD(pieces, lr=0.1))  # elementwise: accepted


def test_refused_idioms_raise_before_any_state_changes():
    run_on_ranks("gloo", _refusals)


def _nanogpt_groups(rank, device):
    """nanoGPT's decay split by `p.dim() >= 2` over the model's parameters, through
    masters.param_groups, equals the same split of unsharded training."""
    group, recipe = dist.group.WORLD, RECIPES["current"]
    ref = Unsharded(build_lm(device), device, group)
    ref.opt = adamw(_split(ref.masters.parameters()), device)
    run = Sharded(build_lm(device), device, group)
    run.opt = adamw(run.masters.param_groups(_split(list(run.model.parameters()))), device)
    assert any(g["weight_decay"] == 0.1 and g["params"] for g in run.opt.param_groups)
    for s in range(STEPS):
        data = batch(s, device, rank, True)
        ref.step(data, recipe)
        run.step(data, recipe)
        compare_models(run.model, ref.model, f"rank {rank} step {s}")


def _split(params) -> list[dict]:
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_param_groups_by_the_models_shapes_equal_unsharded(world):
    run_on_ranks("gloo", _nanogpt_groups, world=world)


def _pretrained(device) -> dict:
    torch.manual_seed(7)
    with g8.fp8_model_init():
        return GainLM(device=device).state_dict()


def _load_after_masters(rank, device, same_data, optimizer_kw=None):
    """model.load_state_dict(pretrained) after the masters: trained from the pretrained weights,
    as DDP (the reference loads before building its masters)."""
    group, recipe, kw = dist.group.WORLD, RECIPES["delayed"], optimizer_kw or {}
    pretrained = _pretrained(device)
    ref_model = build_lm(device)
    ref_model.load_state_dict(pretrained)
    ref = Unsharded(ref_model, device, group, **kw)
    run = Sharded(build_lm(device), device, group, optimizer_kw=kw)
    run.model.load_state_dict(pretrained)
    for s in range(STEPS):
        data = batch(s, device, rank, same_data)
        ref.step(data, recipe)
        run.step(data, recipe)
        compare_models(run.model, ref.model, f"rank {rank} step {s}")


def test_load_state_dict_after_the_masters_is_trained():
    run_on_ranks("gloo", _load_after_masters, False)


def test_load_state_dict_after_the_masters_on_three_ranks():
    run_on_ranks("gloo", _load_after_masters, True, world=3)


def _groups(rank, device):
    """A shard group of 2 of 3 ranks is refused before anything is claimed; shard_group=None
    shards over the default group, as DDP's process_group=None."""
    group, recipe = dist.group.WORLD, RECIPES["delayed"]
    pair, _ = dist.new_subgroups_by_enumeration([[0, 1], [2]])
    model = build_lm(device)
    with pytest.raises(ValueError, match=r"has \d of the 3 ranks.*group\.WORLD"):
        g8.MasterWeights(model, shard_group=pair)
    masters = g8.MasterWeights(model, shard_group=None)  # nothing was claimed by the refusal
    assert isinstance(masters, ShardedMasterWeights) and masters.world == 3
    ref = Unsharded(build_lm(device), device, group)
    run = Sharded.__new__(Sharded)
    run.model, run.group, run.masters = model, group, masters
    run.opt = adamw(masters.parameters(), device)
    for s in range(2):
        data = batch(s, device, rank, True)
        ref.step(data, recipe)
        run.step(data, recipe)
        compare_models(run.model, ref.model, f"rank {rank} step {s}")


def test_shard_groups_smaller_than_the_world_and_none():
    run_on_ranks("gloo", _groups, world=3)


def _frozen_full_state(rank, device):
    """full_state_dict() of a model with a frozen FP8 layer loads into unsharded masters."""
    group, recipe = dist.group.WORLD, RECIPES["delayed"]
    model = build_lm(device)
    model.head.weight.requires_grad_(False)
    run = Sharded(model, device, group)
    run.step(batch(0, device, rank), recipe)
    full = run.masters.full_state_dict()
    if rank != 0:
        return
    fresh = build_lm(device)
    fresh.head.weight.requires_grad_(False)
    unsharded = g8.MasterWeights(fresh)
    unsharded.load_state_dict(full)  # raised: the frozen weight's master was missing
    for name, m in zip(unsharded.names, unsharded.masters, strict=True):
        assert_bitwise_equal(m.detach(), full["masters"][name], f"the master of {name}")
    for (name, p), (_, q) in zip(fresh.named_parameters(), model.named_parameters(), strict=True):
        if isinstance(p, Float8Tensor) and p.requires_grad:
            assert_bitwise_equal(p._data.view(torch.uint8), q._data.view(torch.uint8), name)
    frozen = model.head.weight.dequantize(torch.float32)
    assert_bitwise_equal(full["masters"]["head.weight"], frozen, "the frozen weight's master")


def test_full_state_dict_with_a_frozen_fp8_layer_loads_unsharded():
    run_on_ranks("gloo", _frozen_full_state)


def _different_recipes(rank, device):
    """Rank 0 delayed scaling, rank 1 current scaling: the documented error on every rank, before
    any FP8 state or weight changes (it aborted gloo: one rank all-reduced amaxes, the other
    did not)."""
    group = dist.group.WORLD
    run = Sharded(build_lm(device), device, group)
    before = _snapshot(run)
    recipe = RECIPES["delayed" if rank == 0 else "current"]
    with pytest.raises(RuntimeError, match="different recipes.*rank 1 has a Float8CurrentScaling"):
        microbatches(run.model, batch(0, device, rank), group, recipe)
    _unchanged(run, before, "different recipes")
    run.step(batch(0, device, rank), RECIPES["current"])  # the same recipe on both: trains


def test_ranks_with_different_recipes_raise():
    run_on_ranks("gloo", _different_recipes)
