"""The CUDA backend without debug mode (GRAPHFP8_GRAPH_DEBUG=0, what `bench step` compares):
the same bits as with it, and captured_kernels() says why it cannot list nodes."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models
from tests.helpers import HAS_CUDA
from tests.modules.common import H, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_graphs_without_debug_mode_replay_the_same_bits(monkeypatch):
    debug = build("LayerNormMLP", device="cuda")
    plain = copy.deepcopy(debug)
    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    kw = dict(fp8_enabled=True, fp8_recipe=RECIPE, fp8_weight_caching=True)
    g_debug = g8.make_graphed_callables(debug, (x,), **kw)
    monkeypatch.setenv("GRAPHFP8_GRAPH_DEBUG", "0")
    g_plain = g8.make_graphed_callables(plain, (x,), **kw)
    for mb in range(3):
        xin = torch.randn_like(x)
        ys = []
        for g in (g_debug, g_plain):
            y = g(xin.clone().requires_grad_(), is_first_microbatch=mb == 0)
            y.float().square().sum().backward()
            ys.append(y.clone())
        assert_bitwise_equal(ys[1], ys[0], f"mb {mb}: output")
        compare_models(debug, plain, f"mb {mb}")
    assert g_debug.captured_kernels()["forward"]
    with pytest.raises(RuntimeError, match="GRAPHFP8_GRAPH_DEBUG=0"):
        g_plain.captured_kernels()
