"""Misuse of sharded masters (2 gloo ranks): each raises before any state changes - all-reducing
gradients that the masters reduce-scatter, torch's clip_grad_norm_ of the slices (this rank's norm
only), a step graph with a gradient all-reduce too, an optimizer without the slices, a parameter
without a gradient, a second MasterWeights over the same model, masters built after a capture
(the replay raised nothing when the model had no high-precision parameter). And clipping: the
global norm, which equals unsharded clipping within the last bit of the norm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.distributed import allreduce_gradients
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw, lm_loss
from tests.rank_pool import run_on_ranks
from tests.sharding.common import (
    MB,
    RECIPES,
    Sharded,
    Unsharded,
    batch,
    build_lm,
    microbatches,
)


def _snapshot(run: Sharded) -> list[torch.Tensor]:
    model = [p._data.view(torch.uint8).clone() if isinstance(p, Float8Tensor)
             else p.detach().clone() for p in run.model.parameters()]  # fmt: skip
    grads = [p.grad.clone() for p in run.model.parameters() if p.grad is not None]
    return [*model, *grads, *(m.detach().clone() for m in run.masters.master_shards),
            *(g.clone() for g in run.masters.grad_shards)]  # fmt: skip


def _unchanged(run: Sharded, before: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(_snapshot(run), before, strict=True)):
        assert_bitwise_equal(a, b, f"{what}: tensor {i}")


def _misuse(rank, device):
    group, recipe = dist.group.WORLD, RECIPES["delayed"]
    run = Sharded(build_lm(device), device, group)
    microbatches(run.model, batch(0, device, rank), group, recipe)
    before = _snapshot(run)
    for params in (run.model.parameters(), run.masters.parameters()):
        with pytest.raises(RuntimeError, match="reduced by .*MasterWeights.shard_group"):
            allreduce_gradients(params, group)
        _unchanged(run, before, "allreduce_gradients")
    with pytest.raises(RuntimeError, match="masters.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(run.masters.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="masters.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(run.masters.parameters(), 1.0, foreach=True)
    _unchanged(run, before, "torch's clip_grad_norm_")
    with pytest.raises(RuntimeError, match="cannot be replaced"):
        run.masters.parameters()[0].grad = torch.zeros_like(run.masters.parameters()[0])
    with pytest.raises(ValueError, match="does not hold this rank's fp32 masters"):
        run.masters.step(adamw(run.masters.parameters()[1:], device))
    _unchanged(run, before, "an optimizer without every slice")
    with pytest.raises(ValueError, match="already have fp32 masters"):
        g8.MasterWeights(run.model, shard_group=group)
    _unchanged(run, before, "a second MasterWeights")
    with pytest.raises(ValueError, match="process_group=None"):
        g8.make_graphed_step(run.model, lm_loss, run.opt, batch(9, device), MB,
                             fp8_enabled=True, process_group=group,
                             master_weights=run.masters)  # fmt: skip
    _unchanged(run, before, "make_graphed_step with process_group")
    run.model.gain.grad = None
    with pytest.raises(RuntimeError, match=r"\['gain'\] have no gradient"):
        run.masters.step(run.opt)
    # Masters built after a capture move the FP8 bytes the graphs read: the replay raises.
    with g8.fp8_model_init():
        layer = g8.Linear(32, 32, bias=False, params_dtype=torch.float32)
    x = torch.randn(48, 32, requires_grad=True)
    graphed = g8.make_graphed_callables(layer, (x,), fp8_enabled=True, num_warmup_iters=1)
    g8.MasterWeights(layer, shard_group=group)
    with pytest.raises(RuntimeError, match=r"storage of \['weight data', 'weight scale_inv'\]"):
        graphed(x)


def test_misuse_raises_before_any_state_changes():
    run_on_ranks("gloo", _misuse)


def _clipping(rank, device):
    """Each rank its own data, a norm that clips, 3 steps: the sharded norm (slices' squared
    norms summed over the ranks) and torch's (per-tensor norms, then their norm) add in other
    orders, so they may differ in the last bits: within 2 ulp of float32 (equal here); the
    masters after 3 steps within 1e-6 (equal here)."""
    group, recipe = dist.group.WORLD, RECIPES["current"]
    ref = Unsharded(build_lm(device), device, group)
    run = Sharded(build_lm(device), device, group)
    for s in range(3):
        data = batch(s, device, rank)
        _, norm_ref = ref.step(data, recipe, max_grad_norm=0.05)
        _, norm = run.step(data, recipe, max_grad_norm=0.05)
        assert norm > 0.05 * 4  # the clip scales
        ulp = torch.finfo(torch.float32).eps * float(norm_ref)
        assert abs(float(norm) - float(norm_ref)) <= 2 * ulp, (float(norm), float(norm_ref))
    full = run.masters.full_state_dict()
    if full is not None:
        for name, m in zip(ref.masters.names, ref.masters.masters, strict=True):
            torch.testing.assert_close(full["masters"][name], m.detach(), rtol=0, atol=1e-6)


def test_clipping_is_by_the_global_norm():
    run_on_ranks("gloo", _clipping)
