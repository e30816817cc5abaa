"""The FP8 GEMM that accumulates into an fp32 output in place (fuse_wgrad_accumulation's wgrad
GEMM): against its twin on random data on every device, against torch._scaled_mm + add on CUDA
(cuBLASLt with beta = 1), in a CUDA graph bit for bit as eagerly, and its argument checks."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from tests.helpers import CUDA_PARAM
from tests.ops.test_gemm import _quantized

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
SHAPES = [(32, 64, 48), (7, 16, 16), (96, 256, 128), (0, 32, 16)]
# fp32 sums of k products of O(1) terms in another order: a few ulps of the largest partial sum.
RTOL, ATOL = 1e-5, 1e-5


def _case(mkn, dtypes, device, seed=0):
    torch.manual_seed(seed)
    m, k, n = mkn
    a, sa = _quantized(m, k, dtypes[0], device)
    b_t, sb = _quantized(n, k, dtypes[1], device)
    out = torch.randn(m, n, device=device)
    return a, sa, b_t, sb, out


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("mkn", SHAPES)
def test_accumulates_like_its_twin(device, dtypes, mkn):
    a, sa, b_t, sb, out = _case(mkn, dtypes, device)
    want = out.clone()
    reference.fp8_gemm_accumulate(a, sa, b_t, sb, want)
    got = ops.fp8_gemm_accumulate_(a, sa, b_t.t(), sb, out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)


def test_twice_adds_twice(device):
    a, sa, b_t, sb, out = _case((32, 64, 48), (E4M3, E4M3), device)
    start = out.clone()
    ops.fp8_gemm_accumulate_(a, sa, b_t.t(), sb, out)
    once = out - start
    ops.fp8_gemm_accumulate_(a, sa, b_t.t(), sb, out)
    torch.testing.assert_close(out, start + 2 * once, rtol=RTOL, atol=4 * ATOL)


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("mkn", [(32, 64, 48), (2048, 1024, 768), (4096, 4096, 1024)])
def test_cublaslt_equals_scaled_mm_plus_main_grad(device, dtypes, mkn):
    """cuBLASLt's D = scale_a scale_b (A B) + C against _scaled_mm's fp32 output added to C: the
    same products and accumulator, one rounding apart in the epilogue (a fused multiply-add)."""
    a, sa, b_t, sb, out = _case(mkn, dtypes, device)
    want = out + torch._scaled_mm(a, b_t.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    ops.fp8_gemm_accumulate_(a, sa, b_t.t(), sb, out)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("device", [CUDA_PARAM])
def test_cuda_graph_replay_equals_eager(device):
    a, sa, b_t, sb, out = _case((256, 512, 128), (E5M2, E4M3), device)
    eager = out.clone()
    for _ in range(3):
        ops.fp8_gemm_accumulate_(a, sa, b_t.t(), sb, eager)
    start = out.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: the cuBLASLt handle exists before the capture
        ops.fp8_gemm_accumulate_(a, sa, b_t.t(), sb, out)
    torch.cuda.current_stream().wait_stream(stream)
    out.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.fp8_gemm_accumulate_(a, sa, b_t.t(), sb, out)
    out.copy_(start)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _bad(device, **change):
    a, sa, b_t, sb, out = _case((32, 64, 48), (E4M3, E4M3), device)
    args = dict(a_fp8=a, a_scale_inv=sa, b_fp8=b_t.t(), b_scale_inv=sb, out=out)
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda d: dict(out=torch.zeros(32, 48, dtype=torch.bfloat16, device=d)), TypeError,
         "'out' must be float32"),
        (lambda d: dict(out=torch.zeros(48, 32, device=d)), ValueError, "'out' must have shape"),
        (lambda d: dict(b_fp8=torch.zeros(48, 32, device=d).to(E4M3).t()), ValueError,
         "same inner dim k"),
        (lambda d: dict(b_fp8=torch.zeros(64, 48, device=d).to(E4M3)), ValueError,
         "column-major"),
        (lambda d: dict(a_fp8=torch.zeros(32, 64, device=d).to(E5M2),
                        b_fp8=torch.zeros(48, 64, device=d).to(E5M2).t()), TypeError,
         "E5M2 x E5M2"),
        (lambda d: dict(a_fp8=torch.zeros(32, 40, device=d).to(E4M3),
                        b_fp8=torch.zeros(48, 40, device=d).to(E4M3).t()), ValueError,
         "multiples of 16"),
        (lambda d: dict(a_scale_inv=torch.ones(2, device=d)[1:]), ValueError, "16-byte aligned"),
        (lambda d: dict(a_fp8=torch.zeros(32, 64, device=d)), TypeError, "float8"),
    ],
)  # fmt: skip
def test_argument_errors(device, change, error, words):
    args = _bad(device, **change(device))
    before = args["out"].clone()
    with pytest.raises(error, match=words):
        ops.fp8_gemm_accumulate_(**args)
    assert torch.equal(args["out"], before)
