"""LayerNormLinear / LayerNormMLP under Float8BlockScaling with GRAPHFP8_BLOCKWISE_NORM on: the
norm writes the GEMM's 1x128 tiles itself (graphfp8/modules/_blockwise_norm.py). The forward and
the three gradients bit for bit against the ops they are made of, results close to the switch
off (torch's norm rounds otherwise), the residual path, and graphed == eager for every layer
type with a norm and the step graph."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8 import ops
from graphfp8.modules import _blockwise_norm
from graphfp8.ops import blockwise as bw
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import train_side_by_side
from tests.graphs.step_common import tiny_lm_step_graph_equals_eager

BLOCK = g8.Float8BlockScaling()


@pytest.fixture(autouse=True)
def _fused_norm(monkeypatch):
    monkeypatch.setattr(_blockwise_norm.FUSED, "on", True)
    if not bw.GEMM_MODE:
        monkeypatch.setattr(bw, "GEMM_MODE", "emulate")


def _layer(normalization, zcg=False):
    torch.manual_seed(0)
    layer = g8.LayerNormLinear(144, 160, normalization=normalization, zero_centered_gamma=zcg,
                               params_dtype=torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        layer.layer_norm_weight.add_(torch.randn(144).to(torch.bfloat16) * 0.1)
        if layer.layer_norm_bias is not None:
            layer.layer_norm_bias.add_(torch.randn(144).to(torch.bfloat16) * 0.1)
    return layer


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zcg", [False, True])
def test_layernorm_linear_is_its_ops(normalization, zcg):
    """y = tiles(norm(x)) @ blocks(w).T + b; dy_norm = tiles(dy) @ blocks(w); dx, dgamma, dbeta
    from the norm backward kernel; dw = tiles(dy.T) @ tiles(norm(x).T); partial tiles (K 144,
    M 80)."""
    layer = _layer(normalization, zcg)
    x = torch.randn(80, 144, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(80, 160, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=BLOCK):
        y = layer(x)
    y.backward(dy)
    gamma, beta = layer.layer_norm_weight.detach(), layer.layer_norm_bias
    beta = None if beta is None else beta.detach()
    n = ops.blockwise_norm(x.detach(), gamma, beta, layer.eps, zero_centered_gamma=zcg,
                           transpose=True)  # fmt: skip
    w_fp8, w_inv = bw.quantize_blocks(layer.weight.detach())
    bf16 = torch.bfloat16
    want_y = bw.blockwise_gemm(n.out, n.scale_inv, w_fp8, w_inv, bf16) + layer.bias.detach()
    dy_norm = bw.blockwise_gemm(*bw.quantize_tiles(dy), w_fp8.t().contiguous(),
                                w_inv.t().contiguous(), bf16)  # fmt: skip
    if beta is not None:
        dx, dgamma, dbeta = ops.layernorm_bwd(dy_norm, x.detach(), n.mu, n.rsigma, gamma,
                                              zero_centered_gamma=zcg)  # fmt: skip
        assert_bitwise_equal(layer.layer_norm_bias.grad, dbeta, "dbeta")
    else:
        dx, dgamma = ops.rmsnorm_bwd(dy_norm, x.detach(), n.rsigma, gamma, zero_centered_gamma=zcg)
    want_dw = bw.blockwise_gemm(*bw.quantize_tiles(dy.t()), n.out_t, n.scale_inv_t, bf16)
    assert_bitwise_equal(y, want_y, "y")
    assert_bitwise_equal(x.grad, dx, "dx")
    assert_bitwise_equal(layer.layer_norm_weight.grad, dgamma, "dgamma")
    assert_bitwise_equal(layer.weight.grad, want_dw, "dw")
    assert_bitwise_equal(layer.bias.grad, dy.sum(0), "db")


def _run(layer, x, dy, residual=None):
    x = x.clone().requires_grad_()
    res = None if residual is None else residual.clone().requires_grad_()
    with g8.fp8_autocast(recipe=BLOCK):
        out = layer(x) if res is None else layer(x, residual=res)
    h, y = (None, out) if res is None else out
    loss = (y.float() * dy.float()).sum() + (0 if h is None else h.float().square().sum())
    loss.backward()
    grads = [x.grad] + ([] if res is None else [res.grad])
    return [y] + ([] if h is None else [h]) + grads + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_close_to_the_switch_off(monkeypatch, kind, with_residual):
    """The fused norm differs from torch's norm by rounding only; the residual h = x + residual
    is returned exactly and its gradient reaches x and residual."""
    torch.manual_seed(1)
    make = {
        "LayerNormLinear": lambda: g8.LayerNormLinear(256, 192, params_dtype=torch.bfloat16),
        "LayerNormMLP": lambda: g8.LayerNormMLP(256, 384, params_dtype=torch.bfloat16),
    }[kind]
    layer = make()
    x, res = (torch.randn(96, 256, dtype=torch.bfloat16) for _ in range(2))
    dy = torch.randn(96, 192 if kind == "LayerNormLinear" else 256, dtype=torch.bfloat16)
    residual = res if with_residual else None
    fused = _run(layer, x, dy, residual)
    layer.zero_grad()
    monkeypatch.setattr(_blockwise_norm.FUSED, "on", False)
    plain = _run(layer, x, dy, residual)
    for f, p in zip(fused, plain, strict=True):  # dgamma sums with cancellation: norm-wise
        assert (f.float() - p.float()).norm() <= 0.02 * p.float().norm()
    if with_residual:
        assert_bitwise_equal(fused[1], x + res, "h")


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP", "TransformerLayer"])
def test_graphed_equals_eager(device, kind):
    train_side_by_side(kind, BLOCK, True, device)


def test_step_graph_equals_eager(device):
    tiny_lm_step_graph_equals_eager(device, BLOCK)


def test_the_norm_quantizes_inside_the_graphs():
    """The graph holds blockwise_norm where the norm and the first quantizer were."""
    layer = g8.LayerNormLinear(256, 256, params_dtype=torch.bfloat16)
    sample = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    fwd = graphed.captured_ops()["forward"]
    assert fwd.count("graphfp8::blockwise_norm") == 1
    assert fwd.count("graphfp8::blockwise_quantize") == 1  # the weight's blocks only
