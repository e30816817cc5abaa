"""Bad inputs raise clear errors that name the argument, from the C++ checks."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import HAS_CUDA

E4M3 = torch.float8_e4m3fn


def _cast_args(device="cpu", rows=32, cols=48):
    return dict(
        x=torch.randn(rows, cols, device=device, dtype=torch.bfloat16),
        scale=torch.ones(1, device=device),
        out=torch.empty(rows, cols, dtype=E4M3, device=device),
        out_t=torch.empty(cols, rows, dtype=E4M3, device=device),
        scale_inv=torch.empty(1, device=device),
        amax=torch.zeros(1, device=device),
    )


def _call_cast_transpose(a, noop=None):
    torch.ops.graphfp8.cast_transpose(
        a["x"], a["scale"], a["out"], a["out_t"], a["scale_inv"], a["amax"], noop
    )


@pytest.mark.parametrize(
    "name, bad, pattern",
    [
        ("x", torch.randn(32, 48).int(), r"'x' must be float32, bfloat16 or float16"),
        ("x", torch.randn(48, 32, dtype=torch.bfloat16).t(), r"'x' must be contiguous"),
        ("x", torch.randn(2, 32, 48, dtype=torch.bfloat16), r"'out' must have shape"),
        ("scale", torch.ones(1, dtype=torch.float64), r"'scale' must be float32"),
        ("scale", torch.ones(2), r"'scale' must hold one element"),
        ("out", torch.empty(32, 48, dtype=torch.bfloat16), r"'out' must be float8_e4m3fn or"),
        ("out", torch.empty(32, 47, dtype=E4M3), r"'out' must have shape \[32, 48\]"),
        ("out_t", torch.empty(32, 48, dtype=E4M3), r"'out_t' must have shape \[48, 32\]"),
        ("out_t", torch.empty(48, 32, dtype=torch.float8_e5m2), r"'out' and 'out_t' must have"),
        ("out_t", torch.empty(32, 48, dtype=E4M3).t(), r"'out_t' must be contiguous"),
        ("scale_inv", torch.empty(1, dtype=torch.bfloat16), r"'scale_inv' must be float32"),
        ("amax", torch.zeros(()).long(), r"'amax' must be float32"),
    ],
)
def test_cast_transpose_bad_argument(name, bad, pattern):
    a = _cast_args()
    a[name] = bad
    with pytest.raises(RuntimeError, match=pattern):
        _call_cast_transpose(a)


@pytest.mark.parametrize(
    "noop, pattern",
    [
        (torch.ones(1, dtype=torch.int32), r"'noop' must be float32"),
        (torch.ones(1, dtype=torch.bool), r"'noop' must be float32"),
        (torch.ones(2), r"'noop' must hold one element"),
    ],
)
def test_bad_noop_flag(noop, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        _call_cast_transpose(_cast_args(), noop)
    with pytest.raises(RuntimeError, match=pattern):
        torch.ops.graphfp8.fp8_transpose(
            torch.empty(4, 8, dtype=E4M3), torch.empty(8, 4, dtype=E4M3), noop
        )


def test_transpose_bad_arguments():
    x = torch.empty(4, 8, dtype=E4M3)
    with pytest.raises(RuntimeError, match=r"'x' must be float8_e4m3fn or float8_e5m2"):
        torch.ops.graphfp8.fp8_transpose(torch.empty(4, 8), torch.empty(8, 4, dtype=E4M3))
    with pytest.raises(RuntimeError, match=r"'out_t' must have shape \[8, 4\]"):
        torch.ops.graphfp8.fp8_transpose(x, torch.empty(4, 8, dtype=E4M3))
    with pytest.raises(RuntimeError, match=r"'out_t' must have the dtype of 'x'"):
        torch.ops.graphfp8.fp8_transpose(x, torch.empty(8, 4, dtype=torch.float8_e5m2))
    with pytest.raises(RuntimeError, match=r"'x' must be 2-D"):
        torch.ops.graphfp8.fp8_transpose(
            torch.empty(2, 4, 8, dtype=E4M3), torch.empty(8, 4, dtype=E4M3)
        )


def test_scale_update_bad_arguments():
    h, s, m = torch.zeros(16, 5), torch.ones(5), torch.full((5,), 448.0)
    op = torch.ops.graphfp8.scale_update
    with pytest.raises(RuntimeError, match=r"'amax_history' must be float32"):
        op(h.double(), s, m, False)
    with pytest.raises(RuntimeError, match=r"'amax_history' must be 2-D"):
        op(torch.zeros(16), s, m, False)
    with pytest.raises(RuntimeError, match=r"'amax_history' must be contiguous"):
        op(torch.zeros(5, 16).t(), s, m, False)
    with pytest.raises(RuntimeError, match=r"'scale' must have shape \(5,\)"):
        op(h, torch.ones(4), m, False)
    with pytest.raises(RuntimeError, match=r"'scaled_max' must be float32"):
        op(h, s, m.half(), False)
    with pytest.raises(RuntimeError, match=r"history length >= 1"):
        op(torch.zeros(0, 5), s, m, False)


def test_dequantize_bad_arguments():
    x = torch.empty(4, 8, dtype=E4M3)
    op = torch.ops.graphfp8.dequantize
    with pytest.raises(RuntimeError, match=r"'x' must be float8_e4m3fn or float8_e5m2"):
        op(torch.empty(4, 8), torch.ones(1), torch.empty(4, 8))
    with pytest.raises(RuntimeError, match=r"'out' must be float32, bfloat16 or float16"):
        op(x, torch.ones(1), torch.empty(4, 8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"'out' must have shape \[4, 8\]"):
        op(x, torch.ones(1), torch.empty(8, 4))
    with pytest.raises(RuntimeError, match=r"'scale_inv' must hold one element"):
        op(x, torch.ones(3), torch.empty(4, 8))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["scale", "out", "out_t", "scale_inv", "amax"])
def test_device_mismatch_names_argument(name):
    a = _cast_args("cuda")
    a[name] = a[name].cpu()
    with pytest.raises(
        RuntimeError, match=rf"argument '{name}' is on cpu but the input is on cuda"
    ):
        _call_cast_transpose(a)
