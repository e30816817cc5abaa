"""LayerNormMLP's fused GELU path against the unfused one, and the kernels it runs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.graphs.tape import RecordingMode
from graphfp8.modules import layernorm_mlp
from graphfp8.testing import assert_bitwise_equal, sqnr
from tests.modules.common import H, T, build

RECIPE = g8.DelayedScaling(amax_history_len=4)


def _step(m, x, dy, first: bool, recipe=RECIPE):
    """One FP8 forward + backward; returns (y, {name: grad}) and leaves the grads on m."""
    xi = x.clone().requires_grad_()
    with g8.fp8_autocast(recipe=recipe):
        y = m(xi, is_first_microbatch=first)
    m.zero_grad()
    y.backward(dy)
    return y, {"dgrad": xi.grad, **{n: p.grad for n, p in m.named_parameters()}}


def _data(device):
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    return x, torch.randn(T, H, dtype=torch.bfloat16, device=device)


def test_fused_gelu_mlp_matches_unfused(device, monkeypatch):
    """Same forward bit for bit (the GELU kernel equals torch's on the CPU) and the same forward
    FP8 state; grads and backward state agree up to the fused dbias/dGELU rounding (their fp32
    sums run in another order, and dGELU's tanh differs from torch's by a few fp32 ulp)."""
    monkeypatch.setitem(
        layernorm_mlp.ACTIVATIONS, "gelu_unfused", layernorm_mlp.ACTIVATIONS["gelu"]
    )
    fused = build("LayerNormMLP", device=device)
    unfused = copy.deepcopy(fused)
    unfused.activation = "gelu_unfused"
    for step in range(3):
        x, dy = _data(device)
        y_f, g_f = _step(fused, x, dy, first=step == 0)
        y_u, g_u = _step(unfused, x, dy, first=step == 0)
        if device == "cpu":
            assert_bitwise_equal(y_f, y_u, f"step {step} output")
            assert_bitwise_equal(fused.fp8_meta.fwd.history(), unfused.fp8_meta.fwd.history())
        for name in g_u:
            assert sqnr(g_u[name], g_f[name]) >= 30.0, f"step {step} {name}"
        torch.testing.assert_close(fused.fp8_meta.bwd.scales(), unfused.fp8_meta.bwd.scales(),
                                   rtol=2e-2, atol=0.0)  # fmt: skip


def _op_names(m, device) -> list[str]:
    x, dy = _data(device)
    x.requires_grad_()
    with RecordingMode() as rec:
        with g8.fp8_autocast(recipe=RECIPE):
            y = m(x, is_first_microbatch=True)
        y.backward(dy)
    return rec.names


def test_gelu_mlp_runs_the_fused_kernels():
    names = _op_names(build("LayerNormMLP"), "cpu")
    for op in ("gelu_cast_transpose", "cast_transpose_dbias", "dgelu_cast_transpose_dbias"):
        assert names.count(f"graphfp8::{op}") == 1, op
    # The norm writes fc1's FP8 input; the weights are cast-transposed; no activation or grad
    # cast-transposes remain, and none of torch's LayerNorm kernels.
    assert names.count("graphfp8::layernorm_fp8") == 1
    assert names.count("graphfp8::layernorm_bwd") == 1
    assert names.count("graphfp8::cast_transpose") == 2
    for op in ("aten::gelu", "aten::gelu_backward", "aten::sum", "aten::native_layer_norm",
               "aten::native_layer_norm_backward"):  # fmt: skip
        assert op not in names, op
    assert names.count("aten::_scaled_mm") == 6


def test_relu_mlp_keeps_the_unfused_path():
    m = g8.LayerNormMLP(H, 4 * H, activation="relu", params_dtype=torch.bfloat16)
    names = _op_names(m, "cpu")
    assert "graphfp8::gelu_cast_transpose" not in names
    assert names.count("graphfp8::cast_transpose_dbias") == 2  # each GEMM's grad output


@pytest.mark.parametrize(
    "kind, frozen",
    [*[("LayerNormMLP", f) for f in ("fc1_weight", "fc2_weight", "fc1_bias", "input")],
     *[(k, f) for k in ("SwiGLUMLP", "GeGLUMLP") for f in ("fc1_weight", "fc2_weight", "input")],
     ("GeGLUMLP", "fc1_bias")],
)  # fmt: skip
def test_partial_grads(device, kind, frozen):
    """Whatever is frozen gets no grad; the rest match the all-trainable run (GELU and the
    gated activations)."""
    m = build(kind, device=device)
    ref = copy.deepcopy(m)
    x, dy = _data(device)
    _, want = _step(ref, x, dy, first=True)
    if frozen != "input":
        getattr(m, frozen).requires_grad_(False)
    xi = x.clone().requires_grad_(frozen != "input")
    with g8.fp8_autocast(recipe=RECIPE):
        y = m(xi, is_first_microbatch=True)
    y.backward(dy)
    got = {"dgrad": xi.grad, **{n: p.grad for n, p in m.named_parameters()}}
    for name, g in got.items():
        if name == frozen or (frozen == "input" and name == "dgrad"):
            assert g is None, name
        else:
            assert sqnr(want[name], g) >= 30.0, name


def test_fp32_params_run_the_fused_path():
    m = g8.LayerNormMLP(H, 4 * H, params_dtype=torch.float32)
    x, dy = torch.randn(T, H), torch.randn(T, H)
    _, grads = _step(m, x, dy, first=True)
    want = F.linear(F.gelu(F.linear(F.layer_norm(x, (H,)), m.fc1_weight, m.fc1_bias),
                           approximate="tanh"), m.fc2_weight, m.fc2_bias)  # fmt: skip
    with g8.fp8_autocast(recipe=RECIPE):
        y = m(x, is_first_microbatch=False)
    assert sqnr(want, y) >= 20.0
    assert all(g is not None for g in grads.values())
