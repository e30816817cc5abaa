"""What make_graphed_callables refuses of FSDP2 layers (2 gloo ranks), each before anything runs
and naming the fix: a layer FSDP2 has not initialized (graphfp8.init_fsdp2), the root, a mix of
FSDP2 layers and other callables, a module around several FSDP2 layers, a function over them,
explicit prefetch; a failed capture leaves FSDP2 as it was; after capture, a change of FSDP2's
settings at the next call; reset() gives the layers FSDP2's hooks back, and a call in eval mode
runs the eager forward with FSDP2's hooks, equal to eager FSDP2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import B, H, S, lm_loss
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_graphs import shard_model
from tests.sharding.test_fsdp2_layer_graphs import graph_layers


def _sample(device):
    return (torch.randn(B, S, H, device=device, requires_grad=True),)


def _refused_before_capture(rank, device):
    model = shard_model(build_lm(device), None)
    with pytest.raises(RuntimeError, match=r"FSDP2 has not initialized it .* "
                       r"graphfp8\.init_fsdp2\(model\)"):  # fmt: skip
        g8.make_graphed_callables(model.block, _sample(device))
    with pytest.raises(RuntimeError, match=r"FSDP2's root or holds fully_shard-ed submodules.*"
                       r"make_graphed_microbatch\(model"):  # fmt: skip
        g8.make_graphed_callables(model, _sample(device))
    g8.init_fsdp2(model)
    with pytest.raises(RuntimeError, match=r"FSDP2's root .* model\.layers\[i\]"):
        g8.make_graphed_callables(model, _sample(device))
    with pytest.raises(RuntimeError, match=r"callables \[1\] hold no module under fully_shard"):
        g8.make_graphed_callables((model.block, model.norm), (_sample(device), _sample(device)))
    with pytest.raises(RuntimeError, match=r"is not under fully_shard but holds fully_shard-ed "
                       r"modules \['FSDPTransformerLayer', 'FSDPLinear'\]"):  # fmt: skip
        g8.make_graphed_callables(nn.Sequential(model.block, model.head), _sample(device))
    with pytest.raises(RuntimeError, match=r"cannot capture a function over modules under torch "
                       r"FSDP2 .* the fully_shard-ed layers themselves"):  # fmt: skip
        g8.make_graphed_callables(lambda x: model.block(x), _sample(device))
    model.set_modules_to_forward_prefetch([model.block])
    with pytest.raises(RuntimeError, match=r"explicit prefetch \(set_modules_to_forward_prefetch"):
        g8.make_graphed_callables(model.block, _sample(device))
    model.set_modules_to_forward_prefetch([])
    model.block.set_requires_gradient_sync(False)
    with pytest.raises(RuntimeError, match=r"set_requires_gradient_sync\(False\)"):
        g8.make_graphed_callables(model.block, _sample(device))
    model.block.set_requires_gradient_sync(True)
    assert all(p.grad is None for p in model.parameters()), "nothing ran"
    assert len(model.block._forward_pre_hooks) == 1 and len(model.block._forward_hooks) == 1
    # A capture failing inside the layer (a sample of another width) gives FSDP2 its layer back
    # sharded, with its hooks: eager FSDP2 trains on.
    with pytest.raises(ValueError, match=r"expected input \(batch, seq, 32\)"):
        g8.make_graphed_callables(model.block, (torch.randn(B, S, H + 1, requires_grad=True),),
                                  fp8_enabled=True)  # fmt: skip
    assert model.block._get_fsdp_state()._fsdp_param_group.is_sharded
    assert len(model.block._forward_pre_hooks) == 1 and len(model.block._forward_hooks) == 1
    tokens, targets = batch(0, device, rank)
    with g8.fp8_autocast(recipe=RECIPES["delayed"]):
        out = model(tokens[0])
    lm_loss(out, targets[0]).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fsdp2_layers_refused_before_capture():
    run_on_ranks("gloo", _refused_before_capture)


def _after_capture(rank, device):
    recipe = RECIPES["delayed"]
    model = shard_model(build_lm(device), None)
    eager = shard_model(build_lm(device), None)
    graph_layers(model, recipe, device)
    tokens, _ = batch(0, device, rank)
    assert not model.block._forward_pre_hooks and not model.block._forward_hooks
    changes = [
        (lambda: model.block.set_requires_gradient_sync(False),
         lambda: model.block.set_requires_gradient_sync(True), "reduce_grads"),
        (lambda: model.block.set_reshard_after_forward(False),
         lambda: model.block.set_reshard_after_forward(True), "reshard_after_forward"),
        (lambda: model.block.set_reshard_after_backward(False),
         lambda: model.block.set_reshard_after_backward(True), "reshard_after_backward"),
    ]  # fmt: skip
    for change, undo, what in changes:
        change()
        with pytest.raises(RuntimeError, match=rf"FSDP2's .*{what}.* changed since capture"):
            model.block(*_sample(device), is_first_microbatch=True)
        undo()
    # Eval mode: torch's rule runs the eager forward, with FSDP2's hooks around it.
    outs = []
    for m in (eager, model):
        m.eval()
        with torch.no_grad(), g8.fp8_autocast(recipe=recipe):
            outs.append(m(tokens[0]))
        m.reshard()
        m.train()
    assert_bitwise_equal(outs[1], outs[0], "eval forward")
    model.block.reset()  # the whole capture: both layers get FSDP2's hooks back
    for layer in (model.block, model.head):
        assert "forward" not in vars(layer)
        pre = layer._get_fsdp_state()._pre_forward_hook_handle.id
        assert next(iter(layer._forward_pre_hooks)) == pre
        assert len(layer._forward_hooks) == 1


def test_fsdp2_layers_checked_after_capture():
    run_on_ranks("gloo", _after_capture)
