"""The staged blockwise quantize kernel (kernel switch BLOCK_QUANTIZE_STAGED,
csrc/cuda/blockwise_staged.cuh) writes the CPU kernel's bytes and the default CUDA kernel's:
blocks walking one tile (small shapes) or several (one to eleven rounds), partial last tiles in
rows and columns (widths a multiple of 8 but not of 128; rows not a multiple of 16: out_t's byte
stores), zero, tiny, infinite and NaN tiles, bf16 / fp16, E4M3 / E5M2, both scale rules, the
noop flag inside a CUDA graph; the inputs it leaves to the default kernel still exact with the
switch on."""

from __future__ import annotations

import pytest
import torch

from graphfp8.ops import blockwise_fused as bf
from graphfp8.ops.switches import kernel_switch, switch_on
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import HAS_CUDA
from tests.ops.test_blockwise_fused import _data

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

SWITCH = "BLOCK_QUANTIZE_STAGED"
# (rows, cols): one tile, partial tiles both ways, 792 tiles (two rounds of blocks, rows % 16 = 8),
# the MLP's 4096 x 2048 and 4096 x 16384 (eleven rounds, blocks of ten and eleven tiles)
SHAPES = [(1, 8), (5, 136), (130, 256), (257, 264), (16, 1000), (3000, 4104), (4096, 2048),
          (4096, 16384)]  # fmt: skip


def _quantize(x, staged, fp8_dtype=torch.float8_e4m3fn, power_2_scale=True, **kw):
    with kernel_switch(SWITCH, staged):
        return bf.blockwise_quantize(x, 1, fp8_dtype, power_2_scale, transpose=True, **kw)


def _check(got, want, what):
    assert len(got) == len(want)
    for g, w, name in zip(got, want, ("data", "scale_inv", "data_t", "scale_inv_t"), strict=False):
        assert_bitwise_equal(g.cpu(), w.cpu(), f"{name}: {what}")


def _kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_off_by_default_and_taken_when_on():
    """Off until it has run on a GPU; on, the staged kernel runs (not the default one)."""
    assert not switch_on(SWITCH)
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    on = _kernel_names(lambda: _quantize(x, True))
    off = _kernel_names(lambda: _quantize(x, False))
    assert any("staged_quantize_kernel" in n for n in on), on
    assert not any("staged_quantize_kernel" in n for n in off), off


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_staged_kernel_equals_the_cpu_kernel(shape, dtype):
    x = _data(shape, dtype, seed=5, specials=True)
    want = bf.blockwise_quantize(x, 1, transpose=True)
    gpu = x.cuda()
    _check(_quantize(gpu, True), want, f"staged {shape} {dtype}")
    _check(_quantize(gpu, False), want, f"default {shape} {dtype}")


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("power_2_scale", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_formats_and_scale_rules(fp8_dtype, power_2_scale, dtype):
    x = _data((300, 520), dtype, seed=6, specials=True)
    want = bf.blockwise_quantize(x, 1, fp8_dtype, power_2_scale, transpose=True)
    _check(_quantize(x.cuda(), True, fp8_dtype, power_2_scale), want, f"{fp8_dtype} {dtype}")


def test_nan_and_inf_in_rows_and_columns():
    """A NaN or inf in one row and one column of a tile: those tiles scale by 1 and write 0x7F
    for the NaN, the other rows and columns of the same 128 x 128 region their own scales (the
    kernel skips the NaN rewrite per tile)."""
    x = torch.randn(256, 256, dtype=torch.bfloat16)
    x[3, 7], x[130, 200], x[140, 5] = float("nan"), float("inf"), float("-nan")
    want = bf.blockwise_quantize(x, 1, transpose=True)
    got = _quantize(x.cuda(), True)
    _check(got, want, "specials")
    assert got[0].view(torch.uint8)[3, 7].item() == 0x7F and got[1][3, 0].item() == 1.0
    assert got[2].view(torch.uint8)[7, 3].item() == 0x7F and got[3][7, 0].item() == 1.0


@pytest.mark.parametrize(
    "what",
    ["float32", "cols % 8 != 0", "no transpose", "misaligned x"],
)  # fmt: skip
def test_inputs_it_leaves_to_the_default_kernel(what):
    """With the switch on, inputs outside its reach (float32, widths not a multiple of 8, no
    x.T, an x not 16-byte aligned) take the default kernel: the CPU kernel's bytes."""
    shape = (200, 260) if what == "cols % 8 != 0" else (200, 264)
    x = _data(shape, torch.float32 if what == "float32" else torch.bfloat16, seed=7)
    transpose = what != "no transpose"
    want = bf.blockwise_quantize(x, 1, transpose=transpose)
    if what == "misaligned x":  # one element past a 16-byte boundary
        gpu = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view(shape)
        gpu.copy_(x)
    else:
        gpu = x.cuda()
    with kernel_switch(SWITCH, True):
        names = _kernel_names(lambda: bf.blockwise_quantize(gpu, 1, transpose=transpose))
        got = bf.blockwise_quantize(gpu, 1, transpose=transpose)
    assert not any("staged_quantize_kernel" in n for n in names), names
    _check(got, want, what)


def test_noop_in_a_cuda_graph():
    """Captured with the switch on, the noop flag read at replay."""
    x = _data((512, 1024), torch.bfloat16).cuda()
    out = _quantize(x, True)
    flag = torch.zeros(1, device="cuda")
    _quantize(x, True, out=out, noop=flag)  # warm up the launch (its attributes, once)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with kernel_switch(SWITCH, True), torch.cuda.graph(graph):
        bf.blockwise_quantize(x, 1, transpose=True, out=out, noop=flag)
    x.mul_(2)
    flag.fill_(1)
    graph.replay()
    _check(out, _quantize(x / 2, False), "noop replay")
    flag.fill_(0)
    graph.replay()
    _check(out, _quantize(x, False), "replay")
