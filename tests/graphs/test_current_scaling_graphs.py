"""Float8CurrentScaling inside the graphs: graphed == eager bit for bit (per-callable graphs and
the whole-step graph), and the per-cast amax pass and scale update are captured nodes."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8 import current
from tests.graphs.common import train_side_by_side
from tests.graphs.step_common import tiny_lm_step_graph_equals_eager
from tests.modules.common import H, T

CURRENT = g8.Float8CurrentScaling()


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "Chain", "TransformerLayer"])
@pytest.mark.parametrize("caching", [True, False])
def test_graphed_equals_eager(device, kind, caching):
    train_side_by_side(kind, CURRENT, caching, device)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_graphed_equals_eager_e4m3(device, kind):
    train_side_by_side(kind, g8.Float8CurrentScaling(fp8_format=g8.Format.E4M3), True, device)


@pytest.mark.parametrize("fused", [True, False])
def test_each_cast_updates_its_own_scale_inside_the_graphs(device, fused, monkeypatch):
    """Linear: forward = input and weight casts, backward = the grad-output cast, each an amax
    pass and the cast (the fused path: the cast computes its scale), or an amax pass (a cast),
    a one-slot scale update and the cast. No arena-wide update is captured."""
    monkeypatch.setattr(current, "FUSED_ON_CPU", fused)
    monkeypatch.setattr(current, "FUSED_ON_CUDA", fused)
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=CURRENT,
                                        fp8_weight_caching=True)  # fmt: skip
    ops = graphed.captured_ops()
    amax_pass = "graphfp8::amax" if fused else "graphfp8::cast_to_fp8"
    assert ops["forward"].count(amax_pass) == 2
    assert ops["forward"].count("graphfp8::scale_update") == (0 if fused else 2)
    assert ops["forward"].count("graphfp8::cast_transpose") == 2
    assert ops["backward"].count("graphfp8::scale_update") == (0 if fused else 1)


def test_step_graph_equals_eager(device):
    """The whole training step (TinyLM, 3 microbatches, weight caching) as one graph."""
    tiny_lm_step_graph_equals_eager(device, CURRENT)
