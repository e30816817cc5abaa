"""LayerNormMLP / LayerNormLinear under Float8BlockScaling with GRAPHFP8_BLOCKWISE_GLU_KERNEL on:
the norm and the MLP activation (forward and backward) as graphfp8 kernels in bf16
(graphfp8/modules/_blockwise_plain.py). The MLP's output and input gradient bit for bit against
the ops it is made of, close to the switch-off path (torch's roundings), no torch activation op
or cat left in its graphs, and graphed == eager for the MLP layers, the TransformerLayers and the
step graph."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8 import ops
from graphfp8.modules import _blockwise_plain
from graphfp8.ops import blockwise as bw
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import train_side_by_side
from tests.graphs.step_common import tiny_lm_step_graph_equals_eager
from tests.modules.common import train_once

BLOCK = g8.Float8BlockScaling()
ACTS = ["gelu", "swiglu", "geglu"]
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _plain(monkeypatch):
    monkeypatch.setattr(_blockwise_plain.PLAIN, "on", True)
    if not bw.GEMM_MODE:
        monkeypatch.setattr(bw, "GEMM_MODE", "emulate")


def _mlp(activation, normalization="RMSNorm", bias=True, seed=0):
    """A LayerNormMLP with partial tiles: hidden 144, F 208."""
    torch.manual_seed(seed)
    return g8.LayerNormMLP(144, 208, activation=activation, bias=bias,
                           normalization=normalization, params_dtype=BF16)  # fmt: skip


def _train(layer, x, dy):
    return train_once(layer, x, dy, BLOCK)


def _gemm(x, w, transpose=False):
    """x (M, K) tiles @ w's 128x128 blocks (w.T's with transpose: the dgrad)."""
    w = w.detach()
    blocks = bw.quantize(w, 128, transpose=True)[2:] if transpose else bw.quantize_blocks(w)
    return bw.blockwise_gemm(*bw.quantize_tiles(x), *blocks, BF16)


def _norm(layer, x):
    one, amax = torch.ones(1), torch.ones(1)
    g = layer.layer_norm_weight.detach()
    if layer.normalization == "LayerNorm":
        b = layer.layer_norm_bias.detach()
        return ops.layernorm_fp8(x, g, b, layer.eps, one, amax, torch.float8_e4m3fn, hp_out=True)
    return ops.rmsnorm_fp8(x, g, layer.eps, one, amax, torch.float8_e4m3fn, hp_out=True)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_the_mlp_is_its_kernels_and_gemms(activation, normalization):
    """y and x.grad bit for bit: the norm kernel's bf16 y, fc1, mlp_act, fc2; backward fc2's
    dgrad, mlp_dact, fc1's dgrad, the norm backward kernel."""
    layer = _mlp(activation, normalization, bias=False)
    x, dy = torch.randn(80, 144, dtype=BF16), torch.randn(80, 144, dtype=BF16)
    y, dx, _ = _train(layer, x, dy)
    n = _norm(layer, x)
    h = _gemm(n.out_hp, layer.fc1_weight)
    assert_bitwise_equal(y, _gemm(ops.mlp_act(h, activation), layer.fc2_weight), "y")
    dh = ops.mlp_dact(_gemm(dy, layer.fc2_weight, True), h, activation)
    dn = _gemm(dh, layer.fc1_weight, True)
    g = layer.layer_norm_weight.detach()
    if normalization == "LayerNorm":
        want = ops.layernorm_bwd(dn, x, n.mu, n.rsigma, g)[0]
    else:
        want = ops.rmsnorm_bwd(dn, x, n.rsigma, g)[0]
    assert_bitwise_equal(dx, want, "dx")


@pytest.mark.parametrize("activation", [*ACTS, "relu"])
def test_close_to_the_switch_off(monkeypatch, activation):
    """The kernels' roundings against torch's: y, x.grad and every gradient within 2% (relu
    keeps torch's activation, the norm kernels still run)."""
    layer = _mlp(activation, seed=1)
    x, dy = torch.randn(80, 144, dtype=BF16), torch.randn(80, 144, dtype=BF16)
    on = _train(layer, x, dy)
    monkeypatch.setattr(_blockwise_plain.PLAIN, "on", False)
    off = _train(layer, x, dy)
    pairs = [("y", on[0], off[0]), ("dx", on[1], off[1])]
    pairs += [(k, on[2][k], off[2][k]) for k in on[2]]
    for name, a, b in pairs:
        assert (a.float() - b.float()).norm() <= 0.02 * b.float().norm(), name


def test_the_residual_add_and_its_gradient(monkeypatch):
    """With a residual (TransformerLayer's): h = x + residual from the norm kernel, bit for bit
    torch's add; out, and the gradients of x and the residual (the norm's dx plus h's own
    gradient) within 2% of the switch off."""
    layer = _mlp("swiglu", seed=3)
    x, res, dy, dh = (torch.randn(80, 144, dtype=BF16) for _ in range(4))

    def run():
        xs, rs = x.clone().requires_grad_(), res.clone().requires_grad_()
        with g8.fp8_autocast(recipe=BLOCK):
            h, out = layer(xs, residual=rs)
        torch.autograd.backward((h, out), (dh, dy))
        layer.zero_grad(set_to_none=True)
        return h.detach(), out.detach(), xs.grad, rs.grad

    on = run()
    assert_bitwise_equal(on[0], x + res, "h")
    assert_bitwise_equal(on[2], on[3], "dx = dresidual")
    monkeypatch.setattr(_blockwise_plain.PLAIN, "on", False)
    off = run()
    for name, a, b in zip(("h", "out", "dx", "dresidual"), on, off, strict=True):
        assert (a.float() - b.float()).norm() <= 0.02 * b.float().norm(), name


def test_no_torch_activation_norm_or_cat_in_the_graphs():
    """The forward graph holds mlp_act and the norm kernel, the backward mlp_dact and the norm
    backward kernel, and none of the torch ops of the switch off's activation and norm (its
    silu, silu_backward, cat, pow, mean, rsqrt, sum, div); the aten mm, mul and pads left are
    the CPU's emulated blockwise GEMM."""
    layer = g8.LayerNormMLP(256, 256, activation="swiglu", normalization="RMSNorm",
                            bias=False, params_dtype=BF16)  # fmt: skip
    sample = torch.randn(64, 256, dtype=BF16, requires_grad=True)
    graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    captured = graphed.captured_ops()
    fwd, bwd = captured["forward"], captured["backward"]
    assert fwd.count("graphfp8::mlp_act") == 1 and fwd.count("graphfp8::rmsnorm_fp8") == 1
    assert bwd.count("graphfp8::mlp_dact") == 1 and bwd.count("graphfp8::rmsnorm_bwd") == 1
    banned = {"silu", "silu_backward", "cat", "pow", "mean", "rsqrt", "sum", "div", "add"}
    assert not {f"aten::{b}" for b in banned} & set(fwd + bwd)


def test_weights_in_another_dtype_keep_torch_norm(monkeypatch):
    """A float32 input to bf16 norm weights: the kernels cannot take it, torch's norm runs (as
    with the switch off), bit for bit."""
    layer = g8.LayerNormLinear(144, 256, params_dtype=BF16)
    layer.layer_norm_weight.data = layer.layer_norm_weight.data.float()
    layer.layer_norm_bias.data = layer.layer_norm_bias.data.float()
    x = torch.randn(80, 144, dtype=BF16)
    got = _train(layer, x, torch.randn(80, 256, dtype=BF16))
    monkeypatch.setattr(_blockwise_plain.PLAIN, "on", False)
    want = _train(layer, x, torch.randn(80, 256, dtype=BF16))
    assert_bitwise_equal(got[0], want[0], "y")


@pytest.mark.parametrize(
    "kind", ["LayerNormMLP", "RMSNormMLP", "SwiGLUMLP", "GeGLUMLP", "LayerNormLinear",
             "TransformerLayer", "LlamaLayer"]
)  # fmt: skip
def test_graphed_equals_eager(device, kind):
    train_side_by_side(kind, BLOCK, True, device)


def test_step_graph_equals_eager(device):
    tiny_lm_step_graph_equals_eager(device, BLOCK)
