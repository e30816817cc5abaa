"""Recipe validation, Float8Tensor basics and the arenas (growth, freezing, snapshots)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphfp8 as g8
from graphfp8.fp8 import scaling
from graphfp8.testing import assert_bitwise_equal


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(margin=-1), "margin must be an int >= 0"),
        (dict(margin=0.5), "margin must be an int >= 0"),
        (dict(amax_history_len=0), "amax_history_len must be an int >= 1"),
        (dict(amax_compute_algo="mean"), "amax_compute_algo must be 'max' or 'most_recent'"),
        (dict(fp8_format="HYBRID"), "fp8_format must be a graphfp8.Format"),
        (dict(reduce_amax=1), "reduce_amax must be a bool"),
    ],
)
def test_recipe_validation(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        g8.DelayedScaling(**kwargs)


def test_formats():
    assert g8.Format.HYBRID.fwd_dtype == torch.float8_e4m3fn
    assert g8.Format.HYBRID.bwd_dtype == torch.float8_e5m2
    assert g8.Format.E4M3.bwd_dtype == torch.float8_e4m3fn
    assert g8.DelayedScaling() == g8.DelayedScaling()  # hashable, compared by value


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_float8tensor_construction_launches_nothing():
    data = torch.randint(0, 100, (32, 48), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale_inv = torch.full((1,), 0.5)
    with _CountOps() as mode:
        t = g8.Float8Tensor(data, scale_inv, torch.bfloat16)
    assert mode.ops == []
    assert t.shape == (32, 48) and t.dtype == torch.bfloat16 and t.fp8_dtype == torch.float8_e4m3fn


def test_float8tensor_dequantize_transpose_and_fallback():
    data = torch.randint(0, 100, (32, 48), dtype=torch.uint8).view(torch.float8_e4m3fn)
    t = g8.Float8Tensor(data, torch.full((1,), 0.25), torch.float32)
    want = data.float() * 0.25
    assert_bitwise_equal(t.dequantize(), want)
    tt = t.transpose_fp8()
    assert_bitwise_equal(tt, data.t().contiguous())
    assert t.transpose_fp8() is tt, "cached"
    t.mark_data_changed(transpose_written=False)
    assert not t._transpose_valid
    assert_bitwise_equal(t + 1, want + 1)  # other ops see dequantized values
    d = t.detach()
    assert isinstance(d, g8.Float8Tensor) and d._data is data
    with pytest.raises(NotImplementedError, match="in-place"):
        t.add_(1)


def test_arena_grows_keeps_values_and_refreshes_views():
    recipe = g8.DelayedScaling(amax_history_len=4, margin=1)
    a = scaling.allocate(recipe, "cpu", scaling.FORWARD, 3)
    a.amax(1).fill_(5.0)
    a.scale(2).fill_(7.0)
    b = scaling.allocate(recipe, "cpu", scaling.FORWARD, 2)
    assert a.arena is b.arena and b.start == a.start + 3
    assert a.amax(1).item() == 5.0 and a.scale(2).item() == 7.0, "growth copies old slots"
    a.amax(0).fill_(3.0)
    assert a.arena.amax_history[0, a.start].item() == 3.0, "views follow the new tensor"
    assert a.arena.scaled_max[a.start].item() == 448.0 / 2


def test_frozen_arena_refuses_growth_and_new_modules_get_a_new_one():
    recipe = g8.DelayedScaling(amax_history_len=3)
    a = scaling.allocate(recipe, "cpu", scaling.BACKWARD, 2)
    a.arena.frozen = True
    with pytest.raises(RuntimeError, match="captured in a graph and cannot grow"):
        a.arena.grow(1)
    b = scaling.allocate(recipe, "cpu", scaling.BACKWARD, 2)
    assert b.arena is not a.arena and b.arena.fp8_dtype == torch.float8_e5m2


def test_snapshot_restore():
    recipe = g8.DelayedScaling(amax_history_len=2)
    a = scaling.allocate(recipe, "cpu", scaling.FORWARD, 2)
    snap = a.arena.snapshot()
    before_h, before_s = a.arena.amax_history.clone(), a.arena.scale.clone()
    a.amax(0).fill_(2.0)
    a.arena.update_()
    b = scaling.allocate(recipe, "cpu", scaling.FORWARD, 1)
    b.amax(0).fill_(9.0)
    a.arena.restore_(snap)
    assert_bitwise_equal(a.arena.amax_history[:, : before_h.shape[1]], before_h)
    assert_bitwise_equal(a.arena.scale[: before_s.shape[0]], before_s)
    assert b.amax(0).item() == 0.0 and b.scale(0).item() == 1.0
