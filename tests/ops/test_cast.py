"""cast_to_fp8 and cast_transpose against their reference twins, bit for bit, plus the noop flag."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import FP8_DTYPES, HP_DTYPES, poison

SHAPES_2D = [(1, 1), (1, 33), (7, 1), (37, 53), (64, 64), (128, 48), (96, 4096 + 16), (130, 258)]


def _inputs(shape, dtype, specials):
    x = fp8_test_data(shape, dtype, specials=specials)
    scale = torch.empty(1).uniform_(0.05, 20.0)
    amax0 = torch.empty(1).uniform_(0.0, 1.0)  # a prior amax in the slot: max() must keep it
    return x, scale, amax0


def _run_cast(x, scale, amax0, fp8_dtype, device, transpose, noop=None):
    """Runs the op on `device` and its twin on the CPU; returns both results, CPU tensors."""
    x_d = x.to(device)
    out = poison(torch.empty(x.shape, dtype=fp8_dtype, device=device))
    out_t = (
        poison(torch.empty(x.shape[::-1], dtype=fp8_dtype, device=device)) if transpose else None
    )
    scale_inv = torch.full((1,), 7.0, device=device)
    amax = amax0.clone().to(device)
    noop_d = None if noop is None else noop.to(device)
    if transpose:
        torch.ops.graphfp8.cast_transpose(
            x_d, scale.to(device), out, out_t, scale_inv, amax, noop_d
        )
    else:
        torch.ops.graphfp8.cast_to_fp8(x_d, scale.to(device), out, scale_inv, amax, noop_d)
    got = [t.cpu() for t in (out, out_t, scale_inv, amax) if t is not None]
    ref_out, ref_t = out.cpu().clone(), (out_t.cpu().clone() if transpose else None)
    ref_si, ref_amax = torch.full((1,), 7.0), amax0.clone()
    if transpose:
        reference.cast_transpose(x, scale, ref_out, ref_t, ref_si, ref_amax, noop)
    else:
        reference.cast_to_fp8(x, scale, ref_out, ref_si, ref_amax, noop)
    want = [t for t in (ref_out, ref_t, ref_si, ref_amax) if t is not None]
    return got, want


@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES_2D)
def test_cast_transpose_matches_reference(device, hp_dtype, fp8_dtype, shape):
    x, scale, amax0 = _inputs(shape, hp_dtype, specials=True)
    got, want = _run_cast(x, scale, amax0, fp8_dtype, device, transpose=True)
    for name, g, w in zip(("out", "out_t", "scale_inv", "amax"), got, want, strict=True):
        assert_bitwise_equal(g, w, name)
    assert_bitwise_equal(got[1], got[0].t().contiguous(), "out_t is out.T")


@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (1, 1), (5, 3), (17,), (3, 5, 7), (256, 1024), (1000, 33)])
def test_cast_matches_reference(device, hp_dtype, fp8_dtype, shape):
    x, scale, amax0 = _inputs(shape, hp_dtype, specials=True)
    got, want = _run_cast(x, scale, amax0, fp8_dtype, device, transpose=False)
    for name, g, w in zip(("out", "scale_inv", "amax"), got, want, strict=True):
        assert_bitwise_equal(g, w, name)


def test_cast_saturates_and_canonicalizes_nan():
    x = torch.tensor([1e6, -1e6, 448.0, 449.0, float("inf"), float("nan"), -float("nan"), -0.0])
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    amax, scale_inv = torch.zeros(1), torch.empty(1)
    torch.ops.graphfp8.cast_to_fp8(x, torch.ones(1), out, scale_inv, amax)
    assert out.view(torch.uint8).tolist() == [0x7E, 0xFE, 0x7E, 0x7E, 0x7E, 0x7F, 0x7F, 0x80]
    assert amax.item() == float("inf")  # inf counts, NaN is ignored
    assert scale_inv.item() == 1.0


def test_amax_keeps_larger_prior_value():
    x = torch.full((4, 4), 2.0)
    amax = torch.tensor([5.0])
    ops.cast_transpose(x, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == 5.0
    ops.cast_transpose(x * 4, torch.ones(1), amax, torch.float8_e4m3fn)
    assert amax.item() == 8.0


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape", [(64, 128), (37, 53)])
def test_noop_flag_one_writes_nothing(device, transpose, shape):
    x = fp8_test_data(shape, torch.bfloat16).to(device)
    out = poison(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device))
    out_t = poison(torch.empty(shape[::-1], dtype=torch.float8_e4m3fn, device=device))
    scale_inv = torch.full((1,), 7.0, device=device)
    amax = torch.full((1,), 0.25, device=device)
    before = [t.clone() for t in (out, out_t, scale_inv, amax)]
    noop = torch.ones(1, device=device)
    scale = torch.full((1,), 3.0, device=device)
    if transpose:
        torch.ops.graphfp8.cast_transpose(x, scale, out, out_t, scale_inv, amax, noop)
    else:
        torch.ops.graphfp8.cast_to_fp8(x, scale, out, scale_inv, amax, noop)
    for name, t, b in zip(
        ("out", "out_t", "scale_inv", "amax"), (out, out_t, scale_inv, amax), before, strict=True
    ):
        assert_bitwise_equal(t, b, f"{name} untouched")


@pytest.mark.parametrize("transpose", [False, True])
def test_noop_flag_zero_casts(device, transpose):
    x, scale, amax0 = _inputs((48, 80), torch.float16, specials=False)
    got, want = _run_cast(x, scale, amax0, torch.float8_e5m2, device, transpose, torch.zeros(1))
    for g, w in zip(got, want, strict=True):
        assert_bitwise_equal(g, w)


def test_wrappers_allocate_outputs(device):
    x = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
    amax = torch.zeros(1, device=device)
    x_fp8, x_t_fp8, scale_inv = ops.cast_transpose(
        x, torch.ones(1, device=device), amax, torch.float8_e4m3fn
    )
    assert x_fp8.shape == (32, 48) and x_t_fp8.shape == (48, 32) and scale_inv.shape == (1,)
    y_fp8, scale_inv2 = ops.cast_to_fp8(x, torch.ones(1, device=device), amax, torch.float8_e4m3fn)
    assert_bitwise_equal(y_fp8, x_fp8)
    assert_bitwise_equal(scale_inv2, scale_inv)
