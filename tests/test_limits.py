"""Limits checked at the public entry points instead of failing silently or deep inside an op:
the recipe's margin and history length, convert() on tied weights, the GEMM's output dtype and
FP8 with float64 parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8 import ops
from graphfp8.fp8.recipe import MAX_AMAX_HISTORY_LEN, max_margin

E4M3 = torch.float8_e4m3fn
FLT_MAX = torch.finfo(torch.float32).max
FLT_MIN = torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("margin", [7, 40, 200])
def test_margin_beyond_a_usable_scale_raises(margin):
    with pytest.raises(ValueError, match=f"margin must be <= 6 .*got {margin}"):
        g8.DelayedScaling(margin=margin)


def test_amax_history_len_is_bounded():
    with pytest.raises(ValueError, match="amax_history_len must be <= 65536, got 1000000000"):
        g8.DelayedScaling(amax_history_len=10**9)
    assert g8.DelayedScaling(amax_history_len=MAX_AMAX_HISTORY_LEN).amax_history_len == 1 << 16


@pytest.mark.parametrize("fmt", [g8.Format.HYBRID, g8.Format.E4M3])
def test_largest_margin_keeps_the_scale_math_finite(device, fmt):
    """At the largest accepted margin, the largest finite amax still gives a normal float32
    scale: scale_inv is finite and a cast of FLT_MAX-sized data round-trips without NaN."""
    margin = max_margin(fmt)
    assert margin == 6
    recipe = g8.DelayedScaling(margin=margin, fp8_format=fmt, amax_history_len=2)
    for dtype in (fmt.fwd_dtype, fmt.bwd_dtype):
        limit = (448.0 if dtype == E4M3 else 57344.0) * 2.0**-recipe.margin
        history = torch.tensor([[FLT_MAX], [0.0]], device=device)
        scale = torch.ones(1, device=device)
        ops.scale_update_(history, scale, torch.full((1,), limit, device=device), False)
        assert scale.item() >= FLT_MIN, f"{dtype}: scale {scale.item()} is subnormal"
        x = torch.full((16, 16), FLT_MAX, device=device)
        x_fp8, scale_inv = ops.cast_to_fp8(x, scale, torch.zeros(1, device=device), dtype)
        assert torch.isfinite(scale_inv).all(), f"{dtype}: scale_inv {scale_inv.item()}"
        assert torch.isfinite(x_fp8.float() * scale_inv).all()


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU())
        self.shared = nn.Linear(32, 32)
        self.again = self.shared  # one module reached through two names
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = self.body(self.emb(tokens))
        return self.head(self.again(self.shared(h)))


def test_convert_keeps_tied_weights_and_shared_modules():
    model = _TiedLM()
    params = dict(model.named_parameters())
    count = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 64, (16,))
    want = model(tokens)
    g8.convert(model)
    assert isinstance(model.head, g8.Linear) and isinstance(model.body[1], g8.LayerNormLinear)
    assert model.head.weight is model.emb.weight, "the tie is kept"
    assert model.again is model.shared and isinstance(model.shared, g8.Linear)
    assert sum(p.numel() for p in model.parameters()) == count
    for name, p in model.named_parameters():
        same = [q for q in params.values() if q is p]
        assert same, f"{name} is a new Parameter: an optimizer built before convert() misses it"
    torch.testing.assert_close(model(tokens), want, rtol=0, atol=0)


def test_gemm_refuses_an_integer_output():
    a = torch.zeros(16, 16, dtype=E4M3)
    one = torch.ones(1)
    with pytest.raises(TypeError, match="out_dtype must be bfloat16, float16 or float32"):
        ops.fp8_gemm(a, one, a.t(), one, torch.int32)


def test_fp8_with_float64_parameters_names_params_dtype():
    m = g8.Linear(32, 32, params_dtype=torch.float64)
    x = torch.randn(16, 32, dtype=torch.float64)
    with g8.fp8_autocast(), pytest.raises(TypeError, match=r"torch.float64 \(params_dtype\)"):
        m(x)
    assert m.fp8_meta is None, "nothing was allocated before the error"
