"""LayerNormMLP with the gated activations (SwiGLU, GeGLU): the fused kernels it runs, the
torch-ops fallback that CUDA uses while the fused CUDA kernels are switched off, and the layout
(SQNR against torch is in test_numerics.py, graphed == eager in tests/graphs/)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.modules import _mlp
from graphfp8.ops import glu as glu_ops
from graphfp8.testing import assert_bitwise_equal, sqnr
from tests.graphs.common import train_pair
from tests.helpers import CUDA_PARAM
from tests.modules.common import H, T, build, torch_twin
from tests.modules.test_fused_mlp import _data, _op_names, _step
from tests.ops.test_glu_v2 import glu_kernels

RECIPE = g8.DelayedScaling(amax_history_len=4)
GATED = ["SwiGLUMLP", "GeGLUMLP"]


@pytest.fixture
def fallback(monkeypatch):
    """The path of a device without the fused GLU kernels (CUDA with GRAPHFP8_CUDA_GLU unset)."""
    monkeypatch.setattr(_mlp, "fused_glu_kernels", lambda device: False)


def _use_path(monkeypatch, path: str) -> None:
    """Path "fused": the fused kernels on every device (CUDA too, as GRAPHFP8_CUDA_GLU=1 does);
    "fallback": torch ops and the plain casts everywhere."""
    if path == "fused":
        monkeypatch.setattr(glu_ops, "CUDA_KERNELS", True)
    else:
        monkeypatch.setattr(_mlp, "fused_glu_kernels", lambda device: False)


def test_fc1_holds_gate_then_up():
    m = g8.LayerNormMLP(H, 3 * H, activation="swiglu", bias=False)
    assert m.fc1_weight.shape == (6 * H, H) and m.fc2_weight.shape == (H, 3 * H)
    assert m.fc1_bias is None and m.fc2_bias is None
    x = torch.randn(T, H)
    h = F.linear(F.layer_norm(x, (H,), m.layer_norm_weight, m.layer_norm_bias), m.fc1_weight)
    want = F.linear(F.silu(h[:, : 3 * H]) * h[:, 3 * H :], m.fc2_weight)
    assert_bitwise_equal(m(x), want)


@pytest.mark.parametrize("kind", GATED)
def test_runs_the_fused_kernels(kind):
    m = build(kind)
    names = _op_names(m, "cpu")
    assert names.count("graphfp8::glu_cast_transpose") == 1
    assert names.count("graphfp8::dglu_cast_transpose_dbias") == 1
    # the norm writes fc1's input; only the two weights are cast-transposed; dy's cast carries
    # fc2's dbias when there is one
    assert names.count("graphfp8::cast_transpose") == 2 + (m.fc2_bias is None)
    assert names.count("graphfp8::cast_transpose_dbias") == (m.fc2_bias is not None)
    for op in ("aten::silu", "aten::gelu", "aten::exp", "aten::tanh", "aten::chunk"):
        assert op not in names, op
    assert names.count("aten::_scaled_mm") == 6


@pytest.mark.parametrize("kind", GATED)
def test_fallback_runs_torch_ops_and_the_plain_casts(kind, fallback):
    names = _op_names(build(kind), "cpu")
    assert "graphfp8::glu_cast_transpose" not in names
    assert "graphfp8::dglu_cast_transpose_dbias" not in names
    assert "aten::exp" in names or "aten::tanh" in names
    assert names.count("aten::_scaled_mm") == 6


@pytest.mark.parametrize("kind", GATED)
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_fallback_matches_the_fused_path(device, kind, scaling, monkeypatch):
    """The two paths differ only in the transcendentals' last float32 bits (on the CPU float32
    exp / tanh against float64 ones rounded), so outputs, grads and FP8 state agree closely."""
    recipe = RECIPE if scaling == "delayed" else g8.Float8CurrentScaling()
    fused = build(kind, device=device)
    other = copy.deepcopy(fused)
    for step in range(3):
        x, dy = _data(device)
        with monkeypatch.context() as mp:
            _use_path(mp, "fused")
            y_f, g_f = _step(fused, x, dy, step == 0, recipe)
        with monkeypatch.context() as mp:
            _use_path(mp, "fallback")
            y_o, g_o = _step(other, x, dy, step == 0, recipe)
        assert sqnr(y_f, y_o) >= 40.0, f"step {step} output"
        for name in g_f:
            assert sqnr(g_f[name], g_o[name]) >= 30.0, f"step {step} {name}"
    torch.testing.assert_close(fused.fp8_meta.fwd.scales(), other.fp8_meta.fwd.scales(),
                               rtol=1e-2, atol=0.0)  # fmt: skip


@pytest.mark.parametrize("kind", GATED)
@pytest.mark.parametrize("path", ["fused", "fallback"])
def test_graphed_equals_eager_on_either_path(device, kind, path, monkeypatch):
    _use_path(monkeypatch, path)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    train_pair(build(kind, device=device), sample, RECIPE, True, steps=2, mbs=2)


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("kind", GATED)
@pytest.mark.parametrize("version", ["v2", "v2_div"])
def test_glu_v2_trains_like_the_old_kernels(device, kind, version, monkeypatch):
    """Kernel switches GLU_V2, GLU_V2_DIV (tests/ops/test_glu_v2.py): three eager steps with the
    first kernels and with `version` give the same outputs, gradients and FP8 scales bit for bit,
    and graphed equals eager with `version`."""
    _use_path(monkeypatch, "fused")
    on = build(kind, device=device)
    off = copy.deepcopy(on)
    for step in range(3):
        x, dy = _data(device)
        with glu_kernels("first"):
            y_off, g_off = _step(off, x, dy, step == 0, RECIPE)
        with glu_kernels(version):
            y_on, g_on = _step(on, x, dy, step == 0, RECIPE)
        assert_bitwise_equal(y_on, y_off, f"step {step} output")
        for name in g_on:
            assert_bitwise_equal(g_on[name], g_off[name], f"step {step} {name}")
    for meta in ("fwd", "bwd"):
        assert_bitwise_equal(getattr(on.fp8_meta, meta).scales(),
                             getattr(off.fp8_meta, meta).scales(), meta)  # fmt: skip
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    with glu_kernels(version):
        train_pair(build(kind, device=device), sample, RECIPE, True, steps=2, mbs=2)


@pytest.mark.parametrize("kind", GATED)
def test_outside_autocast_is_torch(kind):
    m = build(kind)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    assert_bitwise_equal(m(x), torch_twin(m)(x))


def test_unknown_activation():
    with pytest.raises(ValueError, match=r"activation must be one of .*'swiglu'"):
        g8.LayerNormMLP(H, 2 * H, activation="reglu")
