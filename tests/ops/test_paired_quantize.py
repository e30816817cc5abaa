"""The cast-transposes with paired saturating converts and word-wide transposed stores (kernel
switch PAIRED_QUANTIZE, csrc/cuda/fp8_util.cuh's quantize4 and tile.cuh's
store_transposed_words) against the kernels they replace: every output byte, amax, scale_inv and
dbias bit for bit, on data salted with every special value (NaN of either sign and any payload,
+-inf, values past the format's range, subnormals, signed zeros) and scales that overflow.
GPU only: the switch changes nothing on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from graphfp8.ops.switches import kernel_switch
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import CUDA_PARAM, FP8_DTYPES, HP_DTYPES

G = torch.ops.graphfp8
OPS = ["cast_transpose", "cast_transpose_dbias", "gelu_cast_transpose",
       "dgelu_cast_transpose_dbias"]  # fmt: skip
# Vector tiles only (the switch leaves the scalar tiles alone): whole and partial 128 x 64
# tiles, and a few hundred tiles per launch.
SHAPES = [(16, 16), (144, 80), (128, 1024), (1040, 2064)]


def _data(shape, dtype):
    x = fp8_test_data(shape, dtype, specials=True)
    flat = x.view(-1)
    if flat.numel() >= 64:  # NaNs with payloads and signs, overflow, subnormals
        raw = torch.tensor([float("nan"), -float("nan"), 1e30, -1e30, 6e-8, -6e-8, 465.0, -61440.0])
        flat[7:15] = raw.to(dtype)
        if dtype == torch.float32:
            flat[20:22].view(torch.int32).copy_(torch.tensor([0x7FA00001, -0x0060_0001]))
    return x.cuda()


def _run(op, x, act_in, scale, fp8_dtype, scaled_max):
    rows, cols = x.shape
    outs = [torch.empty(rows, cols, dtype=fp8_dtype, device="cuda"),
            torch.empty(cols, rows, dtype=fp8_dtype, device="cuda"),
            torch.full((1,), 7.0, device="cuda")]  # fmt: skip
    amax = torch.full((1,), 0.5, device="cuda")
    scale = scale.clone()
    tail = [torch.empty(cols, dtype=x.dtype, device="cuda")] if "dbias" in op else []
    first = [act_in] if op.startswith("dgelu") else []
    kw = {"scaled_max": scaled_max} if op != "cast_transpose" else {}
    if op == "cast_transpose":
        G.cast_transpose(x, scale, *outs, amax, None, scaled_max)
    else:
        getattr(G, op)(x, *first, scale, *outs, amax, *tail, **kw)
    return [*outs, amax, scale, *tail]


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 37.5, math.inf])
def test_paired_quantize_equals_the_old_kernel(device, op, hp_dtype, fp8_dtype, shape, scale):
    x = _data(shape, hp_dtype)
    act_in = (torch.randn(shape) * 3).to(hp_dtype).cuda()
    s = torch.tensor([scale], device="cuda")
    for scaled_max in (None, torch.tensor([448.0], device="cuda")):
        with kernel_switch("PAIRED_QUANTIZE", False):
            want = _run(op, x, act_in, s, fp8_dtype, scaled_max)
        with kernel_switch("PAIRED_QUANTIZE", True):
            got = _run(op, x, act_in, s, fp8_dtype, scaled_max)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(g, w, f"{op} output {i} (scaled_max={scaled_max is not None})")
