"""fp8_transpose (with its noop flag) and dequantize against their reference twins."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import FP8_DTYPES, HP_DTYPES, poison


def _random_fp8(shape, fp8_dtype):
    return torch.randint(0, 256, shape, dtype=torch.uint8).view(fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 1), (1, 70), (33, 1), (64, 64), (48, 80), (37, 53), (300, 1040)]
)
def test_transpose_matches_reference(device, fp8_dtype, shape):
    x = _random_fp8(shape, fp8_dtype)
    out_t = ops.fp8_transpose(
        x.to(device), out_t=poison(torch.empty(shape[::-1], dtype=fp8_dtype, device=device))
    )
    ref = poison(torch.empty(shape[::-1], dtype=fp8_dtype))
    reference.fp8_transpose(x, ref)
    assert_bitwise_equal(out_t, ref)


@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_transpose_noop_flag(device, flag):
    x = _random_fp8((48, 96), torch.float8_e4m3fn).to(device)
    out_t = poison(torch.empty(96, 48, dtype=torch.float8_e4m3fn, device=device))
    before = out_t.clone()
    ops.fp8_transpose(x, out_t=out_t, noop=torch.full((1,), flag, device=device))
    assert_bitwise_equal(out_t, before if flag == 1.0 else x.t().contiguous())


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("out_dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7, 5), (64, 128), (3, 4, 37), (1000, 48)])
def test_dequantize_matches_reference(device, fp8_dtype, out_dtype, shape):
    x = _random_fp8(shape, fp8_dtype)
    x = torch.where(
        torch.isnan(x.float()), torch.zeros_like(x.view(torch.uint8)), x.view(torch.uint8)
    ).view(fp8_dtype)
    scale_inv = torch.empty(1).uniform_(1e-3, 1e2)
    got = ops.dequantize(x.to(device), scale_inv.to(device), out_dtype)
    want = torch.empty(shape, dtype=out_dtype)
    reference.dequantize(x, scale_inv, want)
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_cast_then_dequantize_round_trips_within_fp8_error(device, fp8_dtype):
    x = fp8_test_data((64, 96), torch.float32).clamp(-100, 100).to(device)
    amax = torch.zeros(1, device=device)
    scale = torch.full((1,), 2.0, device=device)
    x_fp8, scale_inv = ops.cast_to_fp8(x, scale, amax, fp8_dtype)
    back = ops.dequantize(x_fp8, scale_inv, torch.float32)
    rel = 2.0**-3 if fp8_dtype == torch.float8_e4m3fn else 2.0**-2  # half an ulp, relative
    big = x.abs() > 0.1
    assert torch.all(((back - x).abs() <= rel * x.abs() + 1e-6)[big])
    assert amax.item() == x.abs().max().item()
