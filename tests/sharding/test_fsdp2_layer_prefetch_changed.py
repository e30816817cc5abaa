"""FSDP2's explicit prefetch set, changed or removed after a per-layer capture (gloo ranks, the
CPU replay tape): the graphs replay the all-gathers they issued at capture, so each change is
refused before a replay changes any state - local shards, `.grad`, masters, optimizer state, FP8
scales and histories compared with a snapshot - naming the fix (put it back, or capture again);
with the capture's prefetch set again (the same modules) training equals eager FSDP2 bit for bit
(docs/sharding.md, "FSDP2 layers in make_graphed_callables")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw, lm_loss
from tests.modules.common import fp8_state
from tests.rank_pool import run_on_ranks
from tests.sharding.common import RECIPES, batch, build_lm
from tests.sharding.test_fsdp2_graphs import compare_local, shard_model
from tests.sharding.test_fsdp2_layer_graphs import _train
from tests.sharding.test_fsdp2_layer_prefetch import _prefetched
from tests.sharding.test_fsdp2_layer_sync_last import graph_layers_last

_CHANGED = r"explicit prefetch of .* changed since capture .* or capture again"


def _model(device, prefetch: bool):
    """The LM under FSDP2 (the layers reshard after forward), with or without the prefetch of
    tests/sharding/test_fsdp2_layer_prefetch.py (block -> head forward, head -> block
    backward)."""
    return _prefetched(device, True, True) if prefetch else shard_model(build_lm(device), True)


def _setup(device, prefetch: bool, graphed: bool):
    g8.reset_state()
    model = _model(device, prefetch)
    masters = g8.MasterWeights(model)
    opt = adamw(masters.parameters(), device)
    if graphed:
        graph_layers_last(model, RECIPES["delayed"], device, fsdp_sync="every")
    return model, masters, opt


def _sharded(model) -> list:
    """FSDP2's sharded parameters (those the model holds while it is not gathered)."""
    states = model._get_fsdp_state()._state_ctx.all_states
    groups = [st._fsdp_param_group for st in states if st._fsdp_param_group is not None]
    return [fp.sharded_param for g in groups for fp in g.fsdp_params]


def _snapshot(model, masters, opt) -> list[torch.Tensor]:
    """Every local shard (FP8 bytes), master, `.grad`, optimizer state, FP8 scale and history."""
    out = []
    for p in _sharded(model) + list(masters.parameters()):
        local = getattr(p, "_local_tensor", p)
        out.append(local._data.view(torch.uint8) if isinstance(local, g8.Float8Tensor) else local)
        out += [] if p.grad is None else [getattr(p.grad, "_local_tensor", p.grad)]
    out += [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    out += [t for _, t in fp8_state(model)]
    return [t.detach().clone() for t in out]


def _microbatch(model, rank, device) -> None:
    """One microbatch as the training loop runs it (the root eager, the layers graphed)."""
    tokens, targets = batch(0, device, rank)
    with g8.fp8_autocast(recipe=RECIPES["delayed"], fp8_group=dist.group.WORLD):
        out = model(tokens[0], is_first_microbatch=True)
    lm_loss(out, targets[0]).backward()


def _refused(model, masters, opt, rank, device, change, undo) -> None:
    before = _snapshot(model, masters, opt)
    change()
    with pytest.raises(RuntimeError, match=_CHANGED):
        _microbatch(model, rank, device)
    undo()
    for layer in (model.block, model.head):  # what the root's prefetch gathered is dropped
        assert layer._get_fsdp_state()._fsdp_param_group._all_gather_result is None
    _same(before, _snapshot(model, masters, opt))


def _changes(model, prefetch: bool) -> list:
    """(change, undo) pairs after capture: added without a captured prefetch; changed and
    removed with one."""
    block, head = model.block, model.head
    root = [  # the root (not graphed) prefetching a graphed layer
        (lambda: model.set_modules_to_backward_prefetch([block]),
         lambda: model.set_modules_to_backward_prefetch([])),
        (lambda: model.set_modules_to_forward_prefetch([block]),
         lambda: model.set_modules_to_forward_prefetch([])),
    ]  # fmt: skip
    if not prefetch:
        return root + [
            (lambda: block.set_modules_to_forward_prefetch([head]),
             lambda: block.set_modules_to_forward_prefetch([])),
            (lambda: head.set_modules_to_backward_prefetch([block]),
             lambda: head.set_modules_to_backward_prefetch([])),
        ]  # fmt: skip
    return root + [
        (lambda: block.set_modules_to_forward_prefetch([]),  # removed
         lambda: block.set_modules_to_forward_prefetch([head])),
        (lambda: head.set_modules_to_backward_prefetch([]),
         lambda: head.set_modules_to_backward_prefetch([block])),
        (lambda: head.set_modules_to_forward_prefetch([block]),  # added beside the captured
         lambda: head.set_modules_to_forward_prefetch([])),
        (lambda: block.set_modules_to_forward_prefetch([head, head]),  # changed
         lambda: block.set_modules_to_forward_prefetch([head])),
    ]  # fmt: skip


def changed_prefetch_refused(rank, device, prefetch: bool) -> None:
    """One training step, each change refused, the step again: equal to eager FSDP2's two
    steps bit for bit."""
    eager, e_masters, e_opt = _setup(device, prefetch, False)
    want = _train(eager, RECIPES["delayed"], rank, device, e_masters, e_opt)
    want += _train(eager, RECIPES["delayed"], rank, device, e_masters, e_opt)
    model, masters, opt = _setup(device, prefetch, True)
    losses = _train(model, RECIPES["delayed"], rank, device, masters, opt)
    for change, undo in _changes(model, prefetch):
        _refused(model, masters, opt, rank, device, change, undo)
    losses += _train(model, RECIPES["delayed"], rank, device, masters, opt)
    assert_bitwise_equal(torch.stack(losses), torch.stack(want), "losses")
    compare_local(eager, model, "after training")
    # Changed between a forward and its backward: refused before the backward graph replays.
    tokens, targets = batch(0, device, rank)
    with g8.fp8_autocast(recipe=RECIPES["delayed"], fp8_group=dist.group.WORLD):
        loss = lm_loss(model(tokens[0], is_first_microbatch=True), targets[0])
    before = _snapshot(model, masters, opt)
    model.head.set_modules_to_backward_prefetch([] if prefetch else [model.block])
    with pytest.raises(RuntimeError, match=_CHANGED):
        loss.backward()
    _same(before, _snapshot(model, masters, opt))


def _same(before: list, after: list) -> None:
    assert len(after) == len(before)
    for j, (a, b) in enumerate(zip(before, after, strict=True)):
        assert_bitwise_equal(b, a, f"state {j} after a refused call")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("prefetch", [False, True], ids=["unset", "set"])
def test_fsdp2_layer_graphs_prefetch_changed_after_capture_is_refused(world, prefetch):
    run_on_ranks("gloo", changed_prefetch_refused, prefetch, world=world)
