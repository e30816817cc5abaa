"""What the graphs refuse of an FSDP2 model (2 gloo ranks), each before anything runs and naming
the fix: the whole model in make_graphed_callables (make_graphed_microbatch and make_graphed_step
capture it; its layers: test_fsdp2_layer_graphs.py), the step
graph's options FSDP2 does not take (process_group, keep_grads_before_clipping, FP8 weights
without their masters), FSDP2 on submodules only, CPU offload, hooks of the user's; after
capture, a change of FSDP2's settings (gradient sync, reshard_after_forward, explicit prefetch),
a group left gathered by an eager forward or a hook is refused at the next call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import graphfp8 as g8
from tests.graphs.step_common import adamw, lm_loss
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_graphs import graphed_microbatch, shard_model
from tests.sharding.test_fsdp2_reshard import shard_lm


def _refused_before_capture(rank, device):
    model = shard_lm(build_lm(device), reshard=True)
    tokens, targets = batch(0, device)
    with pytest.raises(RuntimeError, match=r"make_graphed_callables: .* FSDP2's root or holds "
                       r"fully_shard-ed submodules.* make_graphed_microbatch\(model"):  # fmt: skip
        g8.make_graphed_callables(model, (torch.randn(2, 8, 32, requires_grad=True),))
    opt = adamw(model.parameters(), device)
    with pytest.raises(ValueError, match=r"make_graphed_step: .* FSDP2, whose reduce-scatters .* "
                       r"Pass process_group=None"):  # fmt: skip
        g8.make_graphed_step(model, lm_loss, opt, (tokens, targets), 2, fp8_enabled=True,
                             process_group=dist.group.WORLD)  # fmt: skip
    with pytest.raises(ValueError, match=r"make_graphed_step: keep_grads_before_clipping is not "
                       r"supported for an FSDP2 model"):  # fmt: skip
        g8.make_graphed_step(model, lm_loss, opt, (tokens, targets), 2, fp8_enabled=True,
                             keep_grads_before_clipping=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"make_graphed_step: a model with FP8 primary weights .* "
                       r"master_weights=graphfp8.MasterWeights\(model\)"):  # fmt: skip
        g8.make_graphed_step(model, lm_loss, opt, (tokens, targets), 2, fp8_enabled=True)
    handle = model.block.register_forward_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="must have no hooks"):
        graphed_microbatch(model, RECIPES["delayed"], device)
    handle.remove()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    inner = build_lm(device)
    fully_shard(inner.block, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"under fully_shard itself too"):
        graphed_microbatch(inner, RECIPES["delayed"], device)
    offloaded = build_lm(device, fp8_weights=False)
    fully_shard(offloaded, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    with pytest.raises(RuntimeError, match="CPUOffloadPolicy"):
        graphed_microbatch(offloaded, RECIPES["delayed"], device)
    assert all(p.grad is None for p in model.parameters()), "nothing ran"


def test_refused_before_capture():
    run_on_ranks("gloo", _refused_before_capture)


def _refused_after_capture(rank, device):
    model = shard_model(build_lm(device), None)  # the layers reshard, the root keeps
    graphed = graphed_microbatch(model, RECIPES["current"], device)
    tokens, targets = batch(0, device, rank)
    changes = [
        (lambda: model.set_requires_gradient_sync(False),
         lambda: model.set_requires_gradient_sync(True), "reduce_grads"),
        (lambda: model.block.set_reshard_after_forward(False),
         lambda: model.block.set_reshard_after_forward(True), "reshard_after_forward"),
        (lambda: model.block.set_modules_to_forward_prefetch([model.head]),
         lambda: model.block.set_modules_to_forward_prefetch([]), "explicit prefetch"),
        (lambda: model.set_modules_to_backward_prefetch([model.head]),
         lambda: model.set_modules_to_backward_prefetch([]), "explicit prefetch"),
    ]  # fmt: skip
    for change, undo, what in changes:
        change()
        with pytest.raises(RuntimeError, match=rf"FSDP2's .*{what}.* changed since capture"):
            graphed((tokens[0], targets[0]))
        assert all(p.grad is None for p in model.parameters()), f"{what}: nothing ran"
        undo()
    # An eager forward under no_grad (evaluation) leaves the root gathered (FSDP2's default
    # keeps the root after forward): the call names reshard() (before: "were replaced").
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPES["current"]):
        model(tokens[0])
    with pytest.raises(RuntimeError, match=r"the root'\] gathered.*model\.reshard\(\)"):
        graphed((tokens[0], targets[0]))
    assert all(p.grad is None for p in model.parameters()), "gathered: nothing ran"
    model.reshard()
    handle = model.head.register_forward_pre_hook(lambda *args: None)
    with pytest.raises(RuntimeError, match="hooks were registered on a captured module"):
        graphed((tokens[0], targets[0]))
    handle.remove()
    graphed((tokens[0], targets[0]))  # put back: it runs
    assert all(p.grad is not None for p in model.parameters())


def test_refused_after_capture():
    run_on_ranks("gloo", _refused_after_capture)
