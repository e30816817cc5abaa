"""The fused multi-slot scale update: kernel == reference twin == a literal per-slot loop of
docs/fp8.md's math, bit for bit, on edge cases and random histories."""

from __future__ import annotations

import math

import pytest
import torch

from graphfp8 import reference
from graphfp8.fp8.recipe import fp8_max
from graphfp8.testing import assert_bitwise_equal

FLT_MAX = torch.finfo(torch.float32).max
EDGE_AMAXES = [0.0, 1e-45, 1e-30, 1e-3, 1.0, 3.7, 1e20, 3e38, math.inf, math.nan]


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def literal_update(history: list[float], scale: float, scaled_max: float, algo: str):
    """docs/fp8.md's per-slot pseudo-code, one slot, written as plainly as possible."""
    h = list(history)
    a = h[0]
    if a != 0:
        window = [v for v in h[1:] + [a] if not math.isnan(v)]  # fmaxf ignores NaN
        m = max(window) if window else 0.0
        h = [0.0] + h[2:] + [a] if len(h) > 1 else [0.0]
    else:
        m = 0.0
    amax = m if algo == "max" else a
    s = _f32(scale)
    if math.isfinite(amax) and amax > 0:
        s = _f32(scaled_max) / _f32(amax)
    if math.isinf(s.item()):
        s = _f32(FLT_MAX)
    return h, s.item()


def _arena(length: int, slots: int, margin: int, edge: bool):
    history = torch.rand(length, slots) * torch.pow(
        10.0, torch.empty(length, slots).uniform_(-3, 3)
    )
    history[1:][torch.rand(length - 1, slots) < 0.2] = 0.0
    if edge:
        history[0, : len(EDGE_AMAXES)] = torch.tensor(EDGE_AMAXES)
    scale = torch.empty(slots).uniform_(0.1, 100.0)
    fmt = [torch.float8_e4m3fn if i % 3 else torch.float8_e5m2 for i in range(slots)]
    scaled_max = torch.tensor([fp8_max(f) * 2.0**-margin for f in fmt], dtype=torch.float32)
    return history, scale, scaled_max


@pytest.mark.parametrize("length", [1, 2, 16, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_edge_cases_match_literal_and_reference(device, length, algo, margin):
    history, scale, scaled_max = _arena(length, 13, margin, edge=True)
    h_dev, s_dev = history.clone().to(device), scale.clone().to(device)
    torch.ops.graphfp8.scale_update(h_dev, s_dev, scaled_max.to(device), algo == "most_recent")
    h_ref, s_ref = history.clone(), scale.clone()
    reference.scale_update(h_ref, s_ref, scaled_max, algo == "most_recent")
    assert_bitwise_equal(h_dev, h_ref, "history vs reference")
    assert_bitwise_equal(s_dev, s_ref, "scale vs reference")
    for slot in range(history.shape[1]):
        h_lit, s_lit = literal_update(
            history[:, slot].tolist(), scale[slot].item(), scaled_max[slot].item(), algo
        )
        assert_bitwise_equal(h_ref[:, slot], torch.tensor(h_lit), f"history slot {slot}")
        assert_bitwise_equal(s_ref[slot], _f32(s_lit), f"scale slot {slot}")


def test_edge_semantics_spelled_out():
    history = torch.zeros(4, 5)
    history[0] = torch.tensor([0.0, 1e-45, math.inf, math.nan, 2.0])
    history[1:, 4] = torch.tensor([8.0, 1.0, 0.5])
    scale = torch.full((5,), 3.0)
    torch.ops.graphfp8.scale_update(history, scale, torch.full((5,), 448.0), False)
    assert scale[0] == 3.0, "amax 0: scale kept"
    assert scale[1] == FLT_MAX, "tiny amax: inf scale clamped to FLT_MAX"
    assert scale[2] == 3.0 and scale[3] == 3.0, "inf / NaN amax: scale kept"
    assert scale[4] == 448.0 / 8.0, "m = max(H[1..3], a) = max(8, 1, 0.5, 2): H[1] still counts"
    assert history[:, 4].tolist() == [0.0, 1.0, 0.5, 2.0], "H[1] rolls out after the update"
    assert history[:, 0].tolist() == [0.0, 0.0, 0.0, 0.0], "a == 0: nothing rolls"


@pytest.mark.parametrize("slots", [10, 100, 1000])
def test_many_slots_many_steps(device, slots):
    length = 1024 if slots == 1000 else 16
    history, scale, scaled_max = _arena(length, slots, 1, edge=False)
    h_dev, s_dev, sm_dev = history.to(device), scale.to(device), scaled_max.to(device)
    for step in range(4):
        new = torch.rand(slots) * 10.0**step
        new[torch.rand(slots) < 0.3] = 0.0  # skipped casts keep history and scale
        history[0], h_dev[0] = new, new.to(device)
        torch.ops.graphfp8.scale_update(h_dev, s_dev, sm_dev, step % 2 == 1)
        reference.scale_update(history, scale, scaled_max, step % 2 == 1)
        assert_bitwise_equal(h_dev, history, f"history step {step}")
        assert_bitwise_equal(s_dev, scale, f"scale step {step}")


def test_zero_slots_is_a_noop(device):
    """An arena with no slots: the kernel launches nothing and writes nothing, not even next to
    the empty views (zero-width views into random buffers, compared bit for bit afterwards)."""
    history_buf = torch.rand(16, 8, device=device)
    scale_buf = torch.rand(8, device=device)
    max_buf = torch.rand(8, device=device)
    before = [t.clone() for t in (history_buf, scale_buf, max_buf)]
    out = torch.ops.graphfp8.scale_update(history_buf[:, 3:3], scale_buf[3:3], max_buf[3:3], False)
    assert out is None
    for t, b in zip((history_buf, scale_buf, max_buf), before, strict=True):
        assert_bitwise_equal(t, b)
