"""The SwiGLU / GeGLU cast-transposes of kernel switch GLU_V2 (csrc/cuda/glu_v2.cuh), with and
without SwiGLU's written-out divisions (GLU_V2_DIV), against the kernels they replace: every
output byte of both layouts, amax, scale_inv and dbias (summed in the kernel and by the second
kernel) bit for bit, on moderate gates (the divisions' fast path) and on data salted with the
values where exp and the division leave their fast paths (signed zeros, subnormals, the edges
of the fast range, gates past exp's range, +-inf, NaN), and scales that overflow the FP8 range.
GPU only: the switches change nothing on the CPU."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

from graphfp8.ops.switches import kernel_switch
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import CUDA_PARAM, FP8_DTYPES, HP_DTYPES

G = torch.ops.graphfp8
# (rows, F), vector tiles only (the switch leaves the scalar tiles alone): one partial tile,
# partial tiles in both directions, and a few hundred tiles per launch.
SHAPES = [(16, 16), (144, 80), (256, 1024), (1040, 2064)]
# Gates where exp(-g) overflows or underflows, the division's operands are subnormal or zero,
# and both activations saturate.
SPECIAL_GATES = [0.0, -0.0, 1e-39, -3e-40, 6e-8, -6e-8, 2.3e-10, -2.33e-10, 16.0, 17.0, 21.9,
                 -21.9, 22.0, -22.0, 22.5, -22.5, 88.0, -88.0, 89.0, -104.0, 1e4, -1e4, 3e38,
                 -3e38, math.inf, -math.inf, math.nan]  # fmt: skip
# The kernel switches of each GLU kernel version.
GLU_KERNELS = {
    "first": {"GLU_V2": False, "GLU_V2_DIV": False},
    "v2": {"GLU_V2": True, "GLU_V2_DIV": False},
    "v2_div": {"GLU_V2": True, "GLU_V2_DIV": True},
}


@contextlib.contextmanager
def glu_kernels(version: str) -> Iterator[None]:
    """Runs the block with the GLU kernels `version` (a key of GLU_KERNELS)."""
    with contextlib.ExitStack() as stack:
        for name, on in GLU_KERNELS[version].items():
            stack.enter_context(kernel_switch(name, on))
        yield


def _inputs(rows: int, f: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """h (rows, 2F) and da (rows, F) on the GPU, spanning ~7 decades, salted as above; the gates
    of every other row moderate, so that whole loads of them take the divisions' fast path."""
    h = fp8_test_data((rows, 2 * f), torch.float32, specials=True)
    da = fp8_test_data((rows, f), torch.float32, specials=True)
    h[1::2, :f] = torch.randn(rows // 2, f) * 4
    gates = torch.tensor(SPECIAL_GATES)
    n = min(len(SPECIAL_GATES), f)
    h[0, :n] = gates[:n]  # the gate half of the first row
    h[rows - 1, f - n : f] = gates[:n].flip(0)
    return h.to(dtype).cuda(), da.to(dtype).cuda()


def _run(variant: str, activation: str, h, da, scale, fp8_dtype) -> list[torch.Tensor]:
    rows, f = da.shape
    width = f if variant == "forward" else 2 * f
    out = torch.full((rows, width), 0x55, dtype=torch.uint8, device="cuda").view(fp8_dtype)
    out_t = torch.full((width, rows), 0x55, dtype=torch.uint8, device="cuda").view(fp8_dtype)
    scale_inv, amax = torch.full((1,), 7.0, device="cuda"), torch.full((1,), 0.5, device="cuda")
    if variant == "forward":
        G.glu_cast_transpose(h, activation, scale, out, out_t, scale_inv, amax)
        return [out, out_t, scale_inv, amax]
    dbias = torch.zeros(width, dtype=h.dtype, device="cuda") if "dbias" in variant else None
    G.dglu_cast_transpose_dbias(da, h, activation, scale, out, out_t, scale_inv, amax, dbias)
    return [out, out_t, scale_inv, amax] + ([] if dbias is None else [dbias])


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("variant", ["forward", "backward", "backward_dbias"])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
@pytest.mark.parametrize("hp_dtype", HP_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", [1.0, 37.5, math.inf])
@pytest.mark.parametrize("version", ["v2", "v2_div"])
def test_glu_v2_equals_the_old_kernels(
    device, variant, activation, hp_dtype, fp8_dtype, shape, scale, version
):
    h, da = _inputs(*shape, hp_dtype)
    s = torch.tensor([scale], device="cuda")
    in_kernel = [False, True] if variant == "backward_dbias" else [True]
    for dbias_in_kernel in in_kernel:
        with kernel_switch("DBIAS_IN_KERNEL", dbias_in_kernel):
            with glu_kernels("first"):
                want = _run(variant, activation, h, da, s, fp8_dtype)
            with glu_kernels(version):
                got = _run(variant, activation, h, da, s, fp8_dtype)
        names = ("out", "out_t", "scale_inv", "amax", "dbias")[: len(want)]
        for name, g, w in zip(names, got, want, strict=True):
            assert_bitwise_equal(g, w, f"{variant} {name} (DBIAS_IN_KERNEL={dbias_in_kernel})")
