"""Chained layer graphs (make_graphed_callables(..., chain=True), issue 26): per-layer callables
called in a chain read the previous layer's static output and write their input gradient where
the previous backward reads it, so nothing is copied between layers - and training equals eager
bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphfp8 as g8
from graphfp8.graphs.backends import tape_replays_off
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import backward_and_compare, compare_models
from tests.modules.common import H, T

RECIPE = g8.DelayedScaling(amax_history_len=4)
FP8 = dict(fp8_enabled=True, fp8_recipe=RECIPE, fp8_weight_caching=True)
LAYERS = 3


class Block(nn.Module):
    """A residual FP8 MLP block: x + mlp(x) (the residual inside, so blocks chain)."""

    def __init__(self, device):
        super().__init__()
        self.mlp = g8.LayerNormMLP(H, 2 * H, params_dtype=torch.bfloat16, device=device)

    def forward(self, x, is_first_microbatch=None):
        return x + self.mlp(x, is_first_microbatch=is_first_microbatch)


def _x(device, requires_grad=True):
    return torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=requires_grad)


def _graphed(device, chain=True):
    blocks = [Block(device) for _ in range(LAYERS)]
    eager = copy.deepcopy(blocks)
    samples = tuple((_x(device),) for _ in blocks)
    return eager, blocks, g8.make_graphed_callables(tuple(blocks), samples, chain=chain, **FP8)


def _run(layers, x, first):
    for layer in layers:
        x = layer(x, is_first_microbatch=first)
    return x


def test_chained_layer_graphs_equal_eager(device):
    eager, blocks, graphed = _graphed(device)
    opts = [torch.optim.AdamW([p for b in m for p in b.parameters()], lr=1e-2)
            for m in (eager, blocks)]  # fmt: skip
    for step in range(2):
        for mb in range(3):
            x = torch.randn(T, H, dtype=torch.bfloat16, device=device) * 10.0 ** (mb - 1)
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            with g8.fp8_autocast(recipe=RECIPE):
                ye = _run(eager, xe, mb == 0)
            yg = _run(graphed, xg, mb == 0)
            what = f"step {step} mb {mb}"
            backward_and_compare(ye, yg, xe, xg, what, "input grad")
            for be, bg in zip(eager, blocks, strict=True):
                compare_models(be, bg, what)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


class _Copies(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.copy_.default
        return func(*args, **(kwargs or {}))


def _copies_per_microbatch(graphed, device) -> int:
    x = _x(device)
    _run(graphed, x, True).float().sum().backward()
    with tape_replays_off(), _Copies() as mode:  # the host's copies only, not the tape's ops
        y = _run(graphed, x.detach().clone().requires_grad_(), False)
        y.float().sum().backward()
    return mode.count


def test_no_copy_runs_between_chained_layers(device):
    *_, chained = _graphed(device)
    *_, unchained = _graphed(device, chain=False)
    # One input copy and one grad-output copy in all, against one of each per layer; plus, in
    # both, autograd's clone of the input gradient into the leaf's .grad.
    assert _copies_per_microbatch(chained, device) == 2 + 1
    assert _copies_per_microbatch(unchained, device) == 2 * LAYERS + 1


def test_an_input_from_elsewhere_raises_while_the_previous_backward_waits(device):
    eager, _, graphed = _graphed(device)
    x = _x(device)
    y0 = graphed[0](x, is_first_microbatch=True)
    with pytest.raises(ValueError, match="captured with chain=True, it reads the previous"):
        graphed[1](_x(device), is_first_microbatch=True)
    _run(graphed[1:], y0, True).float().sum().backward()
    with g8.fp8_autocast(recipe=RECIPE):
        ye = _run(eager, x.detach().clone().requires_grad_(), True)
    ye.float().sum().backward()
    with torch.no_grad():  # no backward waits: an input from elsewhere is copied in
        x = _x(device)
        outs = [layer(x, is_first_microbatch=False).clone() for layer in graphed]
        with g8.fp8_autocast(recipe=RECIPE):
            want = [layer(x, is_first_microbatch=False) for layer in eager]
    for i, (a, b) in enumerate(zip(outs, want, strict=True)):
        assert_bitwise_equal(a, b, f"layer {i} on an input from elsewhere")


def test_chain_needs_matching_samples_and_no_order():
    blocks = (g8.Linear(H, 2 * H, params_dtype=torch.bfloat16), Block("cpu"))  # (T, 2H) out
    with pytest.raises(ValueError, match=r"chain=True\): graphed callable 1 .* must be what"):
        g8.make_graphed_callables(blocks, ((_x("cpu"),), (_x("cpu"),)), chain=True)
    with pytest.raises(ValueError, match="not with order="):
        g8.make_graphed_callables(blocks, ((_x("cpu"),),) * 2, chain=True, order=[1, -1])
