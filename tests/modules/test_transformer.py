"""TransformerLayer: rotary embeddings, causality, bad input, checkpoints (numerics against torch
and graphed == eager are in test_numerics.py and tests/graphs/)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.modules.transformer import rope_tables
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, T, build, fp8_state


def _rope(vectors: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """The layer's RoPE kernel on q = k = v = vectors (S, head_dim) float32, one head; returns
    the rotated q (S, head_dim)."""
    s, d = vectors.shape
    cos, sin = rope_tables(s, d, base, torch.float32, "cpu")
    qkv = vectors[None, :, None, :].expand(1, s, 3, d).reshape(1, s, 3 * d).contiguous()
    return g8.ops.rope_qkv(qkv, cos, sin, 1).view(s, 3, d)[:, 0]


def test_rope_is_a_rotation_with_relative_phase():
    """RoPE keeps norms, and <rope(q, m), rope(k, n)> depends only on m - n."""
    q, k = torch.randn(16), torch.randn(16)
    rq, rk = _rope(q.expand(64, 16)), _rope(k.expand(64, 16))
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(64))
    torch.testing.assert_close(rq[10] @ rk[3], rq[40] @ rk[33])
    torch.testing.assert_close(rq[0], q)  # position 0 is the identity


def test_rope_matches_complex_rotation():
    """The half-split layout equals multiplying (x_i, x_{i+d/2}) pairs by exp(i * pos * f_i)."""
    d, s = 8, 5
    x = torch.randn(s, d)
    freqs = 100.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * freqs
    z = torch.complex(x[:, : d // 2].double(), x[:, d // 2 :].double()) * torch.polar(
        torch.ones_like(angle), angle
    )
    want = torch.cat([z.real, z.imag], dim=-1).float()
    torch.testing.assert_close(_rope(x, base=100.0), want)


def test_causal(device):
    """Changing a later token never changes earlier outputs, in FP8 and outside it."""
    m = build("TransformerLayer", device=device)
    x = torch.randn(2, T // 2, H, dtype=torch.bfloat16, device=device)
    x2 = x.clone()
    x2[:, -1] += 1.0
    recipe = g8.DelayedScaling(amax_history_len=1)
    for enabled in (False, True):
        with torch.no_grad(), g8.fp8_autocast(enabled=enabled, recipe=recipe):
            y, y2 = m(x), m(x2)
        assert_bitwise_equal(y[:, :-1], y2[:, :-1], f"fp8={enabled}")
        assert not torch.equal(y[:, -1], y2[:, -1])


def test_fp8_state_round_trips_through_state_dict(device):
    m = build("TransformerLayer", device=device)
    x = torch.randn(2, T // 2, H, dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=g8.DelayedScaling(amax_history_len=4)):
        m(x).sum().backward()
    state = m.state_dict()
    assert not any("rope" in k for k in state), "rotary tables are buffers, not state"
    other = build("TransformerLayer", device=device)
    other.load_state_dict(state)
    for (name, a), (_, b) in zip(fp8_state(m), fp8_state(other), strict=True):
        assert_bitwise_equal(b, a, name)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden_size=32, num_heads=3, ffn_hidden_size=64), "multiple of num_heads"),
        (dict(hidden_size=48, num_heads=16, ffn_hidden_size=64), "even head_dim"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        g8.TransformerLayer(**kwargs)


def test_bad_input(device):
    m = build("TransformerLayer", device=device)
    with pytest.raises(ValueError, match=r"expected input \(batch, seq, 32\)"):
        m(torch.randn(T, H, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        m(torch.randn(1, T + 16, H, dtype=torch.bfloat16, device=device))
    with g8.fp8_autocast(), pytest.raises(TypeError, match="dtype"):
        m(torch.randn(2, T // 2, H, device=device))
