"""Float8CurrentScaling's two launch sequences (graphfp8/fp8/current.py) train bit for bit alike:
the fused path (read-only amax passes, casts that compute their own scale) against the
three-launch path (throwaway cast, one-slot scale update, cast), on every layer kind, with and
without weight caching, eagerly and graphed. On CUDA this is the check that lets the fused path
become the default there (GRAPHFP8_CURRENT_FUSED)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8 import current
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.modules.common import build, input_shape

CURRENT = g8.Float8CurrentScaling()
KINDS = ["Linear", "LayerNormLinear", "RMSNormMLP", "LayerNormMLP", "Chain", "TransformerLayer",
         "RMSNormTransformerLayer"]  # fmt: skip


def _set_fused(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(current, "FUSED_ON_CPU", on)
    monkeypatch.setattr(current, "FUSED_ON_CUDA", on)


def _train(model, fused, monkeypatch, caching, device, graphed=False, steps=2, mbs=3):
    """Trains model on fixed data with the chosen path; returns the outputs and input grads."""
    _set_fused(monkeypatch, fused)
    gen = torch.Generator().manual_seed(11)  # the data, whatever a capture draws

    def randn(like):
        return torch.randn(like.shape, generator=gen).to(like.dtype).to(device)

    sample = torch.zeros(input_shape(model), dtype=torch.bfloat16, device=device)
    call = model
    if graphed:
        call = g8.make_graphed_callables(model, (sample.clone().requires_grad_(),),
                                         fp8_enabled=True, fp8_recipe=CURRENT,
                                         fp8_weight_caching=caching)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    for _ in range(steps):
        for mb in range(mbs):
            first = (mb == 0) if caching else None
            x = (randn(sample) * 10.0 ** (mb - 1)).requires_grad_()
            if graphed:
                y = call(x, is_first_microbatch=first)
            else:
                with g8.fp8_autocast(recipe=CURRENT):
                    y = call(x, is_first_microbatch=first)
            (y.float() * randn(y) * 10.0 ** (1 - mb)).sum().backward()
            seen += [y.detach().clone(), x.grad]  # a graph reuses its output buffer
        opt.step()
        opt.zero_grad()
    return seen


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("caching", [True, False])
def test_fused_path_trains_like_the_three_launch_path(device, kind, caching, monkeypatch):
    old = build(kind, device=device)
    new = copy.deepcopy(old)
    want = _train(old, False, monkeypatch, caching, device)
    got = _train(new, True, monkeypatch, caching, device)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{kind}: tensor {i}")
    compare_models(old, new, kind)


@pytest.mark.parametrize("kind", ["LayerNormMLP", "TransformerLayer"])
def test_fused_path_graphed_equals_three_launch_eager(device, kind, monkeypatch):
    old = build(kind, device=device)
    new = copy.deepcopy(old)
    want = _train(old, False, monkeypatch, True, device)
    got = _train(new, True, monkeypatch, True, device, graphed=True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{kind}: tensor {i}")
    compare_models(old, new, kind)
