"""The FP8 norm path of LayerNormLinear, LayerNormMLP and TransformerLayer: the kernels it runs
(graphfp8's norms, none of torch's), the residual add folded into the MLP's norm against the
unfused add, return_layernorm_output and zero_centered_gamma."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.graphs.tape import RecordingMode
from graphfp8.modules import transformer
from graphfp8.testing import assert_bitwise_equal, sqnr
from tests.modules.common import H, T, build, input_shape

RECIPE = g8.DelayedScaling(amax_history_len=4)
TORCH_NORMS = ("aten::native_layer_norm", "aten::native_layer_norm_backward",
               "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward")  # fmt: skip


def _op_names(m) -> list[str]:
    x = torch.randn(input_shape(m), dtype=torch.bfloat16, requires_grad=True)
    with RecordingMode() as rec:
        with g8.fp8_autocast(recipe=RECIPE):
            y = m(x, is_first_microbatch=True)
        y.float().sum().backward()
    return rec.names


@pytest.mark.parametrize(
    "kind, fwd, bwd, cast_transposes",
    [
        ("LayerNormLinear", "layernorm_fp8", "layernorm_bwd", 1),
        ("RMSNormLinear", "rmsnorm_fp8", "rmsnorm_bwd", 1),
        ("RMSNormMLP", "rmsnorm_fp8", "rmsnorm_bwd", 2),
        ("TransformerLayer", "layernorm_fp8", "layernorm_bwd", 5),
    ],
)
def test_fp8_path_runs_graphfp8_norms(kind, fwd, bwd, cast_transposes):
    names = _op_names(build(kind))
    norms = 2 if kind == "TransformerLayer" else 1
    assert names.count(f"graphfp8::{fwd}") == norms
    assert names.count(f"graphfp8::{bwd}") == norms
    # The norms write their GEMM's FP8 input: only the weights (and, in TransformerLayer, the
    # attention output) are cast-transposed.
    assert names.count("graphfp8::cast_transpose") == cast_transposes
    # torch's RMSNorm is composite (pow, mean, rsqrt, ...) on the CPU: rsqrt gives it away.
    for op in TORCH_NORMS + (("aten::rsqrt",) if "RMS" in kind else ()):
        assert op not in names, op


def _unfused_forward(self, x, is_first_microbatch=None):
    """TransformerLayer.forward with the residual add and the MLP's norm as separate steps."""
    qkv = self.qkv(x, is_first_microbatch=is_first_microbatch)
    h = x + self.proj(self.attention(qkv), is_first_microbatch=is_first_microbatch)
    return h + self.mlp(h, is_first_microbatch=is_first_microbatch)


def test_folded_residual_equals_unfused_add(device, monkeypatch):
    """float32 parameters: the folded add rounds x + attn and dx_norm + dresidual once each, as the
    separate adds do, so outputs, grads and FP8 state agree bit for bit."""
    fused = g8.TransformerLayer(H, 2, 2 * H, max_seq_len=T, params_dtype=torch.float32,
                                device=device)  # fmt: skip
    unfused = copy.deepcopy(fused)
    runs = []
    for model, patched in ((fused, False), (unfused, True)):
        if patched:
            monkeypatch.setattr(transformer.TransformerLayer, "forward", _unfused_forward)
        torch.manual_seed(7)
        for step in range(2):
            x = torch.randn(2, T // 2, H, device=device, requires_grad=True)
            with g8.fp8_autocast(recipe=RECIPE):
                y = model(x, is_first_microbatch=step == 0)
            y.backward(torch.randn_like(y))
        runs.append((y, x.grad, model))
    (y_f, dx_f, m_f), (y_u, dx_u, m_u) = runs
    assert_bitwise_equal(y_f, y_u, "output")
    assert_bitwise_equal(dx_f, dx_u, "dgrad")
    for (name, p_f), (_, p_u) in zip(m_f.named_parameters(), m_u.named_parameters(), strict=True):
        assert_bitwise_equal(p_f.grad, p_u.grad, name)
    for sub in ("qkv", "proj", "mlp"):
        meta_f, meta_u = getattr(m_f, sub).fp8_meta, getattr(m_u, sub).fp8_meta
        assert_bitwise_equal(meta_f.fwd.history(), meta_u.fwd.history(), f"{sub} fwd history")
        assert_bitwise_equal(meta_f.bwd.history(), meta_u.bwd.history(), f"{sub} bwd history")


@pytest.mark.parametrize("fp8", [False, True])
def test_return_layernorm_output(device, fp8):
    m = g8.LayerNormLinear(H, 2 * H, return_layernorm_output=True, params_dtype=torch.float32,
                           device=device)  # fmt: skip
    with torch.no_grad():
        m.layer_norm_weight.normal_(1.0, 0.3)
    x = torch.randn(T, H, device=device, requires_grad=True)
    with g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
        y, ln_out = m(x)
    want = F.layer_norm(x, (H,), m.layer_norm_weight, m.layer_norm_bias, m.eps)
    if fp8:
        torch.testing.assert_close(ln_out, want, rtol=1e-5, atol=1e-5)
    else:
        assert_bitwise_equal(ln_out, want, "ln_out")
    # Both outputs carry gradient into the norm.
    dy, dln = torch.randn_like(y), torch.randn_like(ln_out)
    (y * dy).sum().add((ln_out * dln).sum()).backward()
    x_ref = x.detach().clone().requires_grad_()
    m_ref = copy.deepcopy(m)
    y_ref = F.linear(F.layer_norm(x_ref, (H,), m_ref.layer_norm_weight, m_ref.layer_norm_bias,
                                  m.eps), m_ref.weight, m_ref.bias)  # fmt: skip
    ln_ref = F.layer_norm(x_ref, (H,), m_ref.layer_norm_weight, m_ref.layer_norm_bias, m.eps)
    (y_ref * dy).sum().add((ln_ref * dln).sum()).backward()
    assert sqnr(x_ref.grad, x.grad) >= (25.0 if fp8 else 100.0)


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_zero_centered_gamma(device, kind):
    """gamma starts at 0 and the weight is 1 + gamma: outside fp8_autocast the layer equals the
    plain one with weight gamma + 1; under it, too, within FP8 rounding."""
    cls = g8.LayerNormLinear if kind == "LayerNormLinear" else g8.LayerNormMLP
    zc = cls(H, 2 * H, zero_centered_gamma=True, params_dtype=torch.bfloat16, device=device)
    assert bool((zc.layer_norm_weight == 0).all())
    with torch.no_grad():
        zc.layer_norm_weight.normal_(0.0, 0.3)
    plain = cls(H, 2 * H, params_dtype=torch.bfloat16, device=device)
    plain.load_state_dict(zc.state_dict())
    with torch.no_grad():
        plain.layer_norm_weight.add_(1.0)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    assert_bitwise_equal(zc(x), plain(x), "outside fp8_autocast")
    for _ in range(3):  # warm the scales up
        with g8.fp8_autocast(recipe=RECIPE):
            y_zc, y_plain = zc(x), plain(x)
    assert sqnr(y_plain.float(), y_zc.float()) >= 30.0
