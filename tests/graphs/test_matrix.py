"""A peer's graph test matrix as our own: 3 layers of each kind, run eagerly, graphed as one
nn.Sequential, and graphed layer by layer, trained side by side (SGD, 3 steps x 2 microbatches,
.grad pre-filled with garbage and zeroed with zero_grad(set_to_none=False)), everything
compared bit for bit after every microbatch: outputs, input grads, parameter grads, weights,
FP8 scales and histories. The pipeline schedule of the same issue is in test_schedule.py.

Tiny shapes keep the 36 CPU cases fast; on the H200 the same cases run as CUDA graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.schedules import compare_module
from tests.helpers import poison

HIDDEN, TOKENS, LAYERS, STEPS, MICROBATCHES = 16, 16, 3, 3, 2
RECIPE = g8.DelayedScaling(amax_history_len=4)
FP8_MODES = {"fp8 off": (False, False), "fp8 cached": (True, True), "fp8 uncached": (True, False)}


def _layer(kind: str, dtype, device) -> nn.Module:
    kw = dict(params_dtype=dtype, device=device)
    if kind == "Linear":
        return g8.Linear(HIDDEN, HIDDEN, **kw)
    if kind == "LayerNormLinear":
        return g8.LayerNormLinear(HIDDEN, HIDDEN, **kw)
    if kind == "LayerNormMLP":
        return g8.LayerNormMLP(HIDDEN, 2 * HIDDEN, **kw)
    return g8.TransformerLayer(HIDDEN, 2, 2 * HIDDEN, max_seq_len=TOKENS // 2, **kw)


def _shape(kind: str) -> tuple[int, ...]:
    return (2, TOKENS // 2, HIDDEN) if kind == "TransformerLayer" else (TOKENS, HIDDEN)


class _Runner:
    """One of the three peers: the model, how it is called, its optimizer."""

    def __init__(self, model: nn.Sequential, call):
        self.model, self.call = model, call
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for p in model.parameters():
            p.grad = poison(torch.empty_like(p))
        self.opt.zero_grad(set_to_none=False)


def _peers(kind, dtype, fp8, caching, device) -> list[_Runner]:
    eager = nn.Sequential(*[_layer(kind, dtype, device) for _ in range(LAYERS)])
    whole, per_layer = copy.deepcopy(eager), copy.deepcopy(eager)
    kw = dict(fp8_enabled=fp8, fp8_recipe=RECIPE, fp8_weight_caching=caching, num_warmup_iters=1)
    sample = torch.randn(_shape(kind), dtype=dtype, device=device, requires_grad=True)
    g_whole = g8.make_graphed_callables(whole, (sample,), **kw)
    samples = tuple((torch.randn_like(sample).requires_grad_(),) for _ in range(LAYERS))
    g_layers = g8.make_graphed_callables(tuple(per_layer), samples, **kw)

    def eager_call(x, first):
        with g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
            for layer in eager:
                x = layer(x, is_first_microbatch=first)
        return x

    def layers_call(x, first):
        for layer in g_layers:
            x = layer(x, is_first_microbatch=first)
        return x

    return [
        _Runner(eager, eager_call),
        _Runner(whole, lambda x, first: g_whole(x, is_first_microbatch=first)),
        _Runner(per_layer, layers_call),
    ]


@pytest.mark.parametrize("fp8_mode", list(FP8_MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_graphed_whole_and_per_layer_equal_eager(device, kind, dtype, fp8_mode):
    fp8, caching = FP8_MODES[fp8_mode]
    peers = _peers(kind, dtype, fp8, caching, device)
    names = ["eager", "graphed nn.Sequential", "graphed per layer"]
    for step in range(STEPS):
        for mb in range(MICROBATCHES):
            first = (mb == 0) if caching else None
            x = torch.randn(_shape(kind), dtype=dtype, device=device)
            dy = torch.randn_like(x)
            results = []
            for peer in peers:
                xi = x.clone().requires_grad_()
                y = peer.call(xi, first)
                y.backward(dy)
                results.append((y.detach().clone(), xi.grad))
            for name, peer, (y, dx) in zip(names[1:], peers[1:], results[1:], strict=True):
                what = f"{name}, step {step} mb {mb}"
                assert_bitwise_equal(y, results[0][0], f"{what}: output")
                assert_bitwise_equal(dx, results[0][1], f"{what}: input grad")
                compare_module(peers[0].model, peer.model, what)
        for peer in peers:
            peer.opt.step()
            peer.opt.zero_grad(set_to_none=False)
        for name, peer in zip(names[1:], peers[1:], strict=True):
            compare_module(peers[0].model, peer.model, f"{name}, after step {step}")
