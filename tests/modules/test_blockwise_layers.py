"""The layers under Float8BlockScaling: the three GEMMs of a linear layer quantize each operand
along its own K (graphfp8/modules/_blockwise.py), no FP8 state is kept, blockwise beats per-tensor
current scaling on inputs with outlier channels, and what it does not take raises."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.fp8.recipe import recipe_from_dict, recipe_to_dict
from graphfp8.ops import blockwise as bw
from graphfp8.testing import assert_bitwise_equal, sqnr
from tests.modules.common import build, input_shape

BLOCK = g8.Float8BlockScaling()


def test_linear_runs_the_three_blockwise_gemms():
    """y = x w.T (x tiles along K, w blocks), dx = dy w (dy tiles along N, w's blocks
    transposed), dw = dy.T x (dy.T and x.T tiles along M), db = sum dy; partial tiles (K = 144,
    M = 80) included."""
    layer = g8.Linear(144, 160, params_dtype=torch.bfloat16)
    x = torch.randn(80, 144, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(80, 160, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=BLOCK):
        y = layer(x)
    y.backward(dy)
    w, bf16 = layer.weight.detach(), torch.bfloat16
    w_fp8, w_inv = bw.quantize_blocks(w)
    want_y = bw.blockwise_gemm(*bw.quantize_tiles(x.detach()), w_fp8, w_inv, bf16) + layer.bias
    want_dx = bw.blockwise_gemm(*bw.quantize_tiles(dy), w_fp8.t().contiguous(),
                                w_inv.t().contiguous(), bf16)  # fmt: skip
    want_dw = bw.blockwise_gemm(*bw.quantize_tiles(dy.t()), *bw.quantize_tiles(x.detach().t()),
                                bf16)  # fmt: skip
    assert_bitwise_equal(y, want_y, "y")
    assert_bitwise_equal(x.grad, want_dx, "dx")
    assert_bitwise_equal(layer.weight.grad, want_dw, "dw")
    assert_bitwise_equal(layer.bias.grad, dy.sum(0), "db")
    assert layer.fp8_meta is None  # no slots, no arenas: nothing carries across calls


def test_float32_scales_on_request():
    layer = g8.Linear(128, 128, params_dtype=torch.float32)
    x = torch.randn(16, 128) * 3
    with g8.fp8_autocast(recipe=g8.Float8BlockScaling(power_2_scale=False)):
        y = layer(x)
    x_fp8, x_inv = bw.quantize_tiles(x, power_2_scale=False)
    w_fp8, w_inv = bw.quantize_blocks(layer.weight.detach(), power_2_scale=False)
    want = bw.blockwise_gemm(x_fp8, x_inv, w_fp8, w_inv, torch.float32) + layer.bias
    assert_bitwise_equal(y, want)
    assert not torch.equal(x_inv, bw.quantize_tiles(x)[1])


OUTLIERS = torch.arange(0, 256, 61)  # outlier tokens (attention sinks, say)


def test_blockwise_beats_per_tensor_current_scaling_on_outliers():
    """A few tokens 1e4 x larger than the rest: one per-tensor scale for all of them pushes the
    ordinary tokens into E4M3's subnormals (its normal range is 2**15), while a tile has its own.
    SQNR of the ordinary tokens' outputs and input gradients (their gradients carry outliers
    too) against float64: blockwise's noise is at least 2x lower (the weight's quantization,
    alike in both, bounds the gain)."""
    layer = g8.Linear(512, 256, bias=False, params_dtype=torch.float32)
    x, dy = torch.randn(256, 512), torch.randn(256, 256)
    x[OUTLIERS] *= 1e4
    dy[OUTLIERS] *= 1e4
    ordinary = torch.ones(256, dtype=torch.bool)
    ordinary[OUTLIERS] = False
    w64 = layer.weight.detach().double()
    want_y, want_dx = F.linear(x.double(), w64), dy.double() @ w64
    results = {}
    for name, recipe in (("block", BLOCK), ("current", g8.Float8CurrentScaling())):
        xr = x.clone().requires_grad_()
        with g8.fp8_autocast(recipe=recipe):
            y = layer(xr)
        y.backward(dy)
        results[name] = (sqnr(want_y[ordinary], y[ordinary]),
                         sqnr(want_dx[ordinary], xr.grad[ordinary]))  # fmt: skip
    assert results["block"][0] > results["current"][0] + 3, results
    assert results["block"][1] > results["current"][1] + 3, results


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP", "SwiGLUMLP",
                                  "TransformerLayer"])  # fmt: skip
def test_layers_keep_no_fp8_state(kind):
    m = build(kind)
    x = torch.randn(input_shape(m), dtype=torch.bfloat16, requires_grad=True)
    with g8.fp8_autocast(recipe=BLOCK):
        y = m(x)
    y.float().sum().backward()
    assert all(getattr(s, "fp8_meta", None) is None for s in m.modules())
    with torch.no_grad():  # and it is not the high-precision forward
        assert not torch.equal(y, m(x))


def test_what_blockwise_does_not_take():
    with g8.fp8_model_init(enabled=True):
        layer = g8.Linear(128, 128, params_dtype=torch.bfloat16)
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=BLOCK), pytest.raises(RuntimeError, match="stored per tensor"):
        layer(x)  # blockwise primary weights: fp8_model_init(recipe=BLOCK), test_blockwise_primary
    with pytest.raises(ValueError, match="E4M3"):
        g8.Float8BlockScaling(fp8_format=g8.Format.HYBRID)
    with pytest.raises(ValueError, match="w_block_scaling_dim=2"):
        g8.Float8BlockScaling(w_block_scaling_dim=1)
    with pytest.raises(ValueError, match="power_2_scale"):
        g8.Float8BlockScaling(power_2_scale=1)


def test_recipe_round_trips():
    for recipe in (BLOCK, g8.Float8BlockScaling(power_2_scale=False)):
        assert recipe_from_dict(recipe_to_dict(recipe)) == recipe
