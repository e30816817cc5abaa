"""The fused blockwise quantizer (graphfp8.ops.blockwise_fused, csrc/blockwise.h) bit for bit
against its twin, the torch quantizer of graphfp8/ops/blockwise.py (reference.blockwise_quantize:
every NaN as the canonical 0x7F, which the torch ops write with the NaN's sign at times): 1x128
tiles with and without x.T's tiles, 128x128 blocks with and without their transpose, partial
tiles, zero, tiny, infinite and NaN tiles, bf16 / fp32 / fp16 inputs, E4M3 and E5M2, both scale
rules; the noop flag; the argument checks; the GRAPHFP8_BLOCKWISE_KERNELS switch."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import reference
from graphfp8.ops import blockwise as bw
from graphfp8.ops import blockwise_fused as bf
from graphfp8.testing import assert_bitwise_equal, fp8_test_data
from tests.helpers import HAS_CUDA

SHAPES = [(1, 128), (5, 300), (130, 256), (257, 129), (128, 16), (16, 1000), (256, 384)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def _data(shape, dtype, seed=0, specials=False) -> torch.Tensor:
    """Random data with a zero tile, an outlier, tiny tiles (one of subnormals, whose scale
    overflows to FLT_MAX) and, with
    specials, +-inf, NaN, -NaN and signed zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = fp8_test_data(shape, torch.float32, generator=gen, specials=specials)
    r, c = shape
    x[0, : min(c, 128)] = 0
    if r > 1:
        x[1, c // 2] = 3e4
    if r > 3 and c > 128:
        x[2, 128:256] = x[2, 128:256].nan_to_num(0.0) * 1e-30
        x[3, :128] = x[3, :128].nan_to_num(0.0).clamp(-1, 1) * 1e-39  # subnormal: FLT_MAX scale
    return x.to(dtype)


def _twin(x, block_rows, fp8_dtype, power_2_scale, transpose):
    """reference.blockwise_quantize into the outputs the wrapper would allocate."""
    want = bf.blockwise_quantize(x, block_rows, fp8_dtype, power_2_scale, transpose=transpose)
    want = tuple(torch.full_like(t, 7) if t.dtype == torch.float32 else t.clone() for t in want)
    reference.blockwise_quantize(x, *want[:2], *(want[2:] or (None, None)), block_rows,
                                 power_2_scale)  # fmt: skip
    return want


def check_against_twin(x, block_rows, fp8_dtype, power_2_scale, transpose) -> None:
    got = bf.blockwise_quantize(x, block_rows, fp8_dtype, power_2_scale, transpose=transpose)
    want = _twin(x, block_rows, fp8_dtype, power_2_scale, transpose)
    names = ("data", "scale_inv", "data_t", "scale_inv_t")
    assert len(got) == (4 if transpose else 2)
    for g, w, name in zip(got, want, names, strict=False):
        assert_bitwise_equal(g, w, f"{name} of {tuple(x.shape)} {x.dtype}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("transpose", [False, True])
def test_kernel_equals_the_twin(device, shape, dtype, block_rows, transpose):
    x = _data(shape, dtype, specials=True).to(device)
    check_against_twin(x, block_rows, torch.float8_e4m3fn, True, transpose)


@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("power_2_scale", [True, False])
def test_formats_and_scale_rules(device, block_rows, fp8_dtype, power_2_scale):
    x = _data((200, 260), torch.bfloat16, seed=1, specials=True).to(device)
    check_against_twin(x, block_rows, fp8_dtype, power_2_scale, True)


def test_non_finite_tiles_get_scale_one(device):
    """A tile with inf or NaN scales by 1 (its finite values saturate as x * 1 does); a NaN
    element is 0x7F; a tile's amax over the elements a partial tile has."""
    x = torch.ones(3, 200, device=device)
    x[0, 5], x[1, 7], x[2, 150] = float("inf"), float("nan"), 1000.0
    q, inv, q_t, inv_t = bf.blockwise_quantize(x, 1, transpose=True)
    assert inv.tolist() == [[1.0, 1 / 256], [1.0, 1 / 256], [1 / 256, 4.0]]  # 448/1000 -> 1/4
    assert q.view(torch.uint8)[1, 7] == 0x7F and q[0, 5].float() == 448.0
    assert inv_t[5].item() == 1.0 and inv_t[7].item() == 1.0 and inv_t[0].item() == 1 / 256
    assert inv_t[150].item() == 4.0 and q_t[150, 2].float() == 256.0  # 250 rounded


def test_noop_writes_nothing(device):
    x = _data((130, 260), torch.bfloat16).to(device)
    for block_rows in (1, 128):
        out = bf.blockwise_quantize(x, block_rows, transpose=True)
        before = tuple(t.clone() for t in out)
        flag = torch.ones(1, device=device)
        bf.blockwise_quantize(2 * x, block_rows, transpose=True, out=out, noop=flag)
        for t, b in zip(out, before, strict=True):
            assert_bitwise_equal(t, b, "noop 1")
        flag.zero_()
        bf.blockwise_quantize(2 * x, block_rows, transpose=True, out=out, noop=flag)
        check = bf.blockwise_quantize(2 * x, block_rows, transpose=True)
        for t, c in zip(out, check, strict=True):
            assert_bitwise_equal(t, c, "noop 0")


@pytest.mark.parametrize("mode", ["fused", "torch"])
def test_quantize_with_out_and_noop_on_both_paths(mode):
    """blockwise.quantize writes into `out` and honours the flag on the torch path too (the
    weight cache's graphs read it), the same bytes either way."""
    w = _data((256, 160), torch.bfloat16, seed=2)
    with bf.blockwise_kernels(mode):
        out = bw.quantize(w, 128, transpose=True)
        flag = torch.ones(1)
        bw.quantize(w * 3, 128, transpose=True, out=out, noop=flag)
        want = bf.blockwise_quantize(w, 128, transpose=True)
        for t, c in zip(out, want, strict=True):
            assert_bitwise_equal(t, c, f"{mode}: kept")
        flag.zero_()
        bw.quantize(w * 3, 128, transpose=True, out=out, noop=flag)
    for t, c in zip(out, bf.blockwise_quantize(w * 3, 128, transpose=True), strict=True):
        assert_bitwise_equal(t, c, f"{mode}: written")


def test_the_switch(monkeypatch):
    """Unset: fused on both devices (the CUDA kernel passed its tests on the H200); torch: the
    torch ops on both."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(bf.KERNELS, "mode", "")  # as unset, whatever this run's environment says
    assert bf.fused_on(cpu) and bf.fused_on(cuda)
    with bf.blockwise_kernels("torch"):
        assert not bf.fused_on(cpu) and not bf.fused_on(cuda)
        with bf.blockwise_kernels("fused"):
            assert bf.fused_on(cuda)
    assert bf.KERNELS.mode == ""
    monkeypatch.setattr(bf.KERNELS, "mode", "Fused")
    with pytest.raises(ValueError, match="GRAPHFP8_BLOCKWISE_KERNELS='Fused': give 'fused'"):
        bw.quantize_tiles(torch.ones(2, 128))
    with pytest.raises(ValueError, match="mode must be one of"):
        with bf.blockwise_kernels("cuda"):
            pass


def test_argument_checks():
    x = torch.randn(4, 256)
    out = bf.blockwise_quantize(x)
    q = torch.ops.graphfp8.blockwise_quantize
    with pytest.raises(RuntimeError, match="'block_rows' must be 1 .* or 128"):
        q(x, out[0], out[1], None, None, 64)
    with pytest.raises(RuntimeError, match="argument 'x' must be contiguous"):
        q(torch.randn(256, 4).t(), out[0], out[1])
    with pytest.raises(RuntimeError, match=r"'scale_inv' must have shape \[4, 2\], got \[1, 2\]"):
        q(x, out[0], torch.empty(1, 2))
    with pytest.raises(RuntimeError, match="give 'out_t' and 'scale_inv_t' together"):
        q(x, out[0], out[1], torch.empty(256, 4, dtype=torch.float8_e4m3fn), None)
    with pytest.raises(RuntimeError, match=r"'scale_inv_t' must have shape \[256, 1\]"):
        q(x, out[0], out[1], torch.empty(256, 4, dtype=torch.float8_e4m3fn), torch.empty(2, 1))
    with pytest.raises(ValueError, match="must be 2-D"):
        bf.blockwise_quantize(torch.randn(2, 2, 128))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_rows", [1, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_kernel_equals_the_cpu_kernel(block_rows, dtype):
    """The CUDA kernel (vector and scalar paths: whole tiles, partial ones, odd widths) writes
    the CPU kernel's bytes."""
    for shape in ((1024, 2048), (384, 256), (257, 129), (1, 300), (130, 1000)):
        x = _data(shape, dtype, seed=3, specials=True)
        cpu = bf.blockwise_quantize(x, block_rows, transpose=True)
        gpu = bf.blockwise_quantize(x.cuda(), block_rows, transpose=True)
        for g, c in zip(gpu, cpu, strict=True):
            assert_bitwise_equal(g.cpu(), c, f"{shape} {dtype}")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "shape, variants",
    [((4096, 2048), [(1, True)]), ((4096, 8192), [(1, True)]), ((4096, 16384), [(1, True)]),
     ((4056, 2120), [(1, True), (1, False), (128, True), (128, False)])],
)  # fmt: skip
def test_cuda_kernel_at_the_mlp_shapes(shape, variants):
    """The shapes of the Llama-1B SwiGLU MLP's quantized operands (issue 42's speed row: x and
    dy, the SwiGLU output, its gradient) with the recipe's 1x128 tiles of x and x.T, and a
    partial-tile shape (rows not a multiple of 16: the byte stores of out_t) in every variant:
    the CPU kernel's bytes."""
    x = _data(shape, torch.bfloat16, seed=4, specials=True)
    for block_rows, transpose in variants:
        cpu = bf.blockwise_quantize(x, block_rows, transpose=transpose)
        gpu = bf.blockwise_quantize(x.cuda(), block_rows, transpose=transpose)
        for g, c in zip(gpu, cpu, strict=True):
            assert_bitwise_equal(g.cpu(), c, f"{shape} {block_rows} transpose={transpose}")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_kernel_in_a_cuda_graph():
    """Captured, with the noop flag read at replay."""
    x = _data((512, 1024), torch.bfloat16).cuda()
    out = bf.blockwise_quantize(x, 1, transpose=True)
    flag = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    bf.blockwise_quantize(x, 1, transpose=True, out=out, noop=flag)  # warm up the launch
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        bf.blockwise_quantize(x, 1, transpose=True, out=out, noop=flag)
    x.mul_(2)
    flag.fill_(1)
    graph.replay()
    for t, w in zip(out, bf.blockwise_quantize(x / 2, 1, transpose=True), strict=True):
        assert_bitwise_equal(t, w, "noop replay")
    flag.fill_(0)
    graph.replay()
    for t, w in zip(out, bf.blockwise_quantize(x, 1, transpose=True), strict=True):
        assert_bitwise_equal(t, w, "replay")
