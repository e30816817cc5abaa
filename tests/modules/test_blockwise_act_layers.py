"""LayerNormMLP under Float8BlockScaling with GRAPHFP8_BLOCKWISE_ACT on: the GELU / SwiGLU /
GeGLU writes fc2's 1x128 tiles itself (graphfp8/modules/_blockwise_act.py). fc2's forward and
gradients bit for bit against the ops they are made of, every gradient before fc2 bit for bit
the switch-off path's (the same dgrad GEMM and activation backward), the output close to it,
and graphed == eager for the MLP layers, the TransformerLayers and the step graph."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8 import ops, reference_blockwise
from graphfp8.modules import _blockwise_act, _blockwise_norm, _blockwise_plain, layernorm_mlp
from graphfp8.numerics_blockwise import BlockStats
from graphfp8.ops import blockwise as bw
from graphfp8.ops.blockwise_stats import STATS, block_stats
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import train_side_by_side
from tests.graphs.step_common import tiny_lm_step_graph_equals_eager
from tests.modules.common import train_once

BLOCK = g8.Float8BlockScaling()
ACTS = ["gelu", "swiglu", "geglu"]


@pytest.fixture(autouse=True)
def _fused_act(monkeypatch):
    """BLOCKWISE_ACT on; the switch-off path it is compared with is torch's (the plain kernels of
    BLOCKWISE_GLU_KERNEL, on by default, have their own tests)."""
    monkeypatch.setattr(_blockwise_act.FUSED, "on", True)
    monkeypatch.setattr(_blockwise_plain.PLAIN, "on", False)
    if not bw.GEMM_MODE:
        monkeypatch.setattr(bw, "GEMM_MODE", "emulate")


def _mlp(activation, bias=True, seed=0):
    """A LayerNormMLP with partial tiles: hidden 144, F 208, 80 tokens."""
    torch.manual_seed(seed)
    return g8.LayerNormMLP(144, 208, activation=activation, bias=bias,
                           params_dtype=torch.bfloat16)  # fmt: skip


def _train(layer, x, dy):
    return train_once(layer, x, dy, BLOCK)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("bias", [True, False])
def test_fc2_is_its_ops_and_the_rest_is_the_switch_off(monkeypatch, activation, bias):
    """y = tiles(act(h)) @ blocks(w2).T + b2 and dw2 = tiles(dy.T) @ tiles(act(h).T), for h the
    fc1 output the layer computed; x.grad and the grads of the norm and fc1 equal the switch
    off's bit for bit, y and dw2 are close to it (the activation's last bits)."""
    layer = _mlp(activation, bias)
    x = torch.randn(80, 144, dtype=torch.bfloat16)
    dy = torch.randn(80, 144, dtype=torch.bfloat16)
    seen = _spy_on_h(monkeypatch)
    y, dx, grads = _train(layer, x, dy)
    assert len(seen) == 1
    a = ops.blockwise_act(seen[0], activation, transpose=True)
    w_fp8, w_inv = bw.quantize_blocks(layer.fc2_weight.detach())
    want_y = bw.blockwise_gemm(a.out, a.scale_inv, w_fp8, w_inv, torch.bfloat16)
    want_y = want_y + layer.fc2_bias.detach() if bias else want_y
    want_dw2 = bw.blockwise_gemm(*bw.quantize_tiles(dy.t()), a.out_t, a.scale_inv_t,
                                 torch.bfloat16)  # fmt: skip
    assert_bitwise_equal(y, want_y, "y")
    assert_bitwise_equal(grads["fc2_weight"], want_dw2, "dw2")
    monkeypatch.setattr(_blockwise_act.FUSED, "on", False)
    y_off, dx_off, grads_off = _train(layer, x, dy)
    assert_bitwise_equal(dx, dx_off, "dx")
    for name, g in grads.items():
        if name == "fc2_weight":
            assert (g.float() - grads_off[name].float()).norm() <= 0.02 * g.float().norm()
        else:
            assert_bitwise_equal(g, grads_off[name], name)
    assert (y.float() - y_off.float()).norm() <= 0.02 * y_off.float().norm()


def _spy_on_h(monkeypatch) -> list:
    """Records the fc1 output h that LayerNormMLP hands to act_linear."""
    seen = []

    def spy(h, *args, **kwargs):
        seen.append(h.detach().clone())
        return _blockwise_act.act_linear(h, *args, **kwargs)

    monkeypatch.setattr(layernorm_mlp, "act_linear", spy)
    return seen


def test_the_numerics_report_sees_the_fused_activation(monkeypatch):
    """BlockStats' row of fc2's input is the statistics of the tiles the kernel wrote against
    the activation's values (on the CPU the kernel's own: csrc/blockwise_act.h)."""
    layer = _mlp("swiglu", seed=2)
    x, dy = (torch.randn(80, 144, dtype=torch.bfloat16) for _ in range(2))
    seen = _spy_on_h(monkeypatch)
    with BlockStats(layer) as stats:
        stats.enable(True)
        _train(layer, x, dy)
        stats.collect(0, 0)
        row = next(r for r in stats.rows() if (r["gemm"], r["role"]) == ("fc2", "input"))
    a = ops.blockwise_act(seen[0], "swiglu")
    values = reference_blockwise.act_values(seen[0], "swiglu")
    want = dict(zip(STATS, block_stats(values, a.out, a.scale_inv, 1).tolist(), strict=True))
    assert (row["numel"], row["blocks"]) == (80 * 208, 80 * 2)
    assert row["true_amax"] == want["amax"] == float(values.float().abs().max())
    assert row["underflow_frac"] == want["underflow"] / want["nonzero"]


def test_the_norm_and_the_activation_fused_together(monkeypatch):
    """With GRAPHFP8_BLOCKWISE_NORM on too, neither the norm's nor the activation's output is
    quantized by a separate quantizer: the forward's blockwise_quantize calls are the weights'."""
    monkeypatch.setattr(_blockwise_norm.FUSED, "on", True)
    layer = g8.LayerNormMLP(256, 256, activation="swiglu", params_dtype=torch.bfloat16)
    sample = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    fwd = graphed.captured_ops()["forward"]
    assert fwd.count("graphfp8::blockwise_norm") == 1
    assert fwd.count("graphfp8::blockwise_act") == 1
    assert fwd.count("graphfp8::blockwise_quantize") == 2  # fc1's and fc2's weight blocks


def test_the_activation_quantizes_inside_the_graphs():
    """The graph holds blockwise_act where the activation and fc2's input quantizer were."""
    layer = g8.LayerNormMLP(256, 256, params_dtype=torch.bfloat16)
    sample = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    fwd = graphed.captured_ops()["forward"]
    assert fwd.count("graphfp8::blockwise_act") == 1
    assert fwd.count("graphfp8::blockwise_quantize") == 3  # fc1's input and the two weights


@pytest.mark.parametrize(
    "kind", ["LayerNormMLP", "SwiGLUMLP", "GeGLUMLP", "TransformerLayer", "LlamaLayer"]
)
def test_graphed_equals_eager(device, kind):
    train_side_by_side(kind, BLOCK, True, device)


def test_step_graph_equals_eager(device):
    tiny_lm_step_graph_equals_eager(device, BLOCK)
