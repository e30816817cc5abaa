"""The FP8 GEMM writing into its output with alpha and beta read from device memory
(graphfp8.ops.fp8_gemm_into_, WGRAD_INTO_GRAD's wgrad GEMM): against its twin on random data and
bit for bit where every sum is exact, beta 0 ignoring NaN in the output as cuBLAS does, the sum
rounded once to bf16, beta read when a captured graph replays (CPU tape and CUDA graph), and its
argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.graphs.backends import new_graph
from tests.helpers import CUDA_PARAM
from tests.ops.test_gemm import _quantized

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One rounding of an fp32 sum taken in another order: a few fp32 ulps, then at most one ulp of
# the output dtype; Hopper's FP8 MMA accumulates at reduced precision (test_gemm_accumulate.py).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CUDA_TOL = 5e-3


def _scalars(beta: float, device) -> torch.Tensor:
    return torch.tensor([1.0, beta], device=device)


def _case(mkn, dtypes, out_dtype, device, seed=0):
    torch.manual_seed(seed)
    m, k, n = mkn
    a, sa = _quantized(m, k, dtypes[0], device)
    b_t, sb = _quantized(n, k, dtypes[1], device)
    return a, sa, b_t, sb, torch.randn(m, n, device=device).to(out_dtype)


def _integers(m, k, n, device, seed=0):
    """Operands of small integers (exact in E4M3) with scale_inv 1: every partial sum is an
    integer of at most 16 * k, exact in fp32 and in Hopper's FP8 accumulation alike, so any
    summation order gives the same fp32 sum."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-4, 5, (m, k), generator=gen).float().to(E4M3).to(device)
    b_t = torch.randint(-4, 5, (n, k), generator=gen).float().to(E4M3).to(device)
    one = torch.ones(1, device=device)
    return a, one, b_t, one.clone()


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("mkn", [(32, 64, 48), (7, 16, 16), (96, 256, 128)])
def test_writes_like_its_twin(device, mkn, dtypes, out_dtype, beta):
    a, sa, b_t, sb, out = _case(mkn, dtypes, out_dtype, device)
    want = out.clone()
    reference.fp8_gemm_into(a, sa, b_t, sb, want, _scalars(beta, device))
    got = ops.fp8_gemm_into_(a, sa, b_t.t(), sb, out, _scalars(beta, device))
    assert got is out and out.dtype == out_dtype
    tol = TOL[out_dtype] if device == "cpu" else max(CUDA_TOL, TOL[out_dtype])
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_bit_for_bit_with_its_twin_where_sums_are_exact(device, out_dtype, beta):
    a, sa, b_t, sb = _integers(48, 32, 32, device)
    out = (torch.randn(48, 32, device=device) * 100).to(out_dtype)
    want = out.clone()
    reference.fp8_gemm_into(a, sa, b_t, sb, want, _scalars(beta, device))
    ops.fp8_gemm_into_(a, sa, b_t.t(), sb, out, _scalars(beta, device))
    assert torch.equal(out, want)


def test_the_sum_is_rounded_once(device):
    """dot = 257 (16 * 16 + 1 * 1) onto 1.0 in bf16: 258 rounded once; a bf16 dW first (257 ->
    256, the tie to even) then added gives 256 + 1 -> 256."""
    a = torch.zeros(16, 16, device=device)
    a[0, :2] = torch.tensor([16.0, 1.0])
    a, b_t, one = a.to(E4M3), a.to(E4M3), torch.ones(1, device=device)
    out = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    ops.fp8_gemm_into_(a, one, b_t.t(), one.clone(), out, _scalars(1.0, device))
    assert out[0, 0].item() == 258.0
    twice = torch.tensor(257.0).to(torch.bfloat16) + torch.tensor(1.0, dtype=torch.bfloat16)
    assert twice.item() == 256.0


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_beta_zero_ignores_nan_in_the_output(device, out_dtype):
    """cuBLAS's beta = 0 never reads C: NaN and infinities there do not reach the result; with
    beta = 1 they do."""
    a, sa, b_t, sb = _integers(16, 32, 16, device)
    product = torch.zeros(16, 16, dtype=out_dtype, device=device)
    ops.fp8_gemm_into_(a, sa, b_t.t(), sb, product, _scalars(0.0, device))
    for beta in (0.0, 1.0):
        poisoned = torch.full((16, 16), math.nan, dtype=out_dtype, device=device)
        poisoned[0, :3] = torch.tensor([math.inf, -math.inf, -0.0])
        ops.fp8_gemm_into_(a, sa, b_t.t(), sb, poisoned, _scalars(beta, device))
        if beta == 0.0:
            assert torch.equal(poisoned, product)
        else:
            assert torch.isnan(poisoned[1:]).all() and torch.isinf(poisoned[0, :2]).all()


def test_minus_zero_with_beta_one_equals_beta_zero(device):
    """The graphs' mixed case: a buffer filled with -0.0 and beta 1 gives the product's bits, as
    beta 0 does (x + -0.0 is x, +0.0 and NaN included)."""
    a, sa, b_t, sb, _ = _case((32, 64, 48), (E4M3, E4M3), torch.bfloat16, device)
    a[0].zero_()  # a row of +0.0 products
    zero = torch.zeros(32, 48, dtype=torch.bfloat16, device=device)
    ops.fp8_gemm_into_(a, sa, b_t.t(), sb, zero, _scalars(0.0, device))
    filled = torch.full((32, 48), -0.0, dtype=torch.bfloat16, device=device)
    ops.fp8_gemm_into_(a, sa, b_t.t(), sb, filled, _scalars(1.0, device))
    assert torch.equal(filled, zero) and not torch.signbit(filled[0]).any()


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
def test_a_captured_gemm_reads_beta_at_each_replay(device):
    """One graph (the CPU tape, a CUDA graph) writes the product while beta is 0 and adds it
    while beta is 1: the same bits as the eager calls with those scalars."""
    a, sa, b_t, sb, start = _case((64, 128, 32), (E5M2, E4M3), torch.bfloat16, device)
    eager = start.clone()
    for beta in (0.0, 1.0, 1.0):
        ops.fp8_gemm_into_(a, sa, b_t.t(), sb, eager, _scalars(beta, device))
    scalars, out = _scalars(1.0, device), start.clone()
    ops.fp8_gemm_into_(a, sa, b_t.t(), sb, out, scalars)  # the cuBLASLt handle before capture
    graph = new_graph(torch.device(device))
    with graph.capture():
        ops.fp8_gemm_into_(a, sa, b_t.t(), sb, out, scalars)
    out.copy_(torch.full_like(out, math.nan))  # beta 0 must not read it
    for beta in (0.0, 1.0, 1.0):
        scalars[1] = beta
        graph.replay()
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _bad(device, **change):
    a, sa, b_t, sb, out = _case((32, 64, 48), (E4M3, E4M3), torch.bfloat16, device)
    args = dict(a_fp8=a, a_scale_inv=sa, b_fp8=b_t.t(), b_scale_inv=sb, out=out,
                alpha_beta=_scalars(1.0, device))  # fmt: skip
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda d: dict(out=torch.zeros(32, 48, dtype=torch.int32, device=d)), TypeError,
         "float32, bfloat16 or float16"),
        (lambda d: dict(out=torch.zeros(48, 32, dtype=torch.bfloat16, device=d)), ValueError,
         "'out' must have shape"),
        (lambda d: dict(alpha_beta=torch.ones(1, device=d)), ValueError, "two elements"),
        (lambda d: dict(alpha_beta=torch.ones(2, dtype=torch.float64, device=d)), TypeError,
         "'alpha_beta' must be float32"),
        (lambda d: dict(out=torch.zeros(32, 56, dtype=torch.bfloat16, device=d)[:, :48]),
         RuntimeError, "contiguous"),
        (lambda d: dict(b_fp8=torch.zeros(64, 48, device=d).to(E4M3)), ValueError,
         "column-major"),
        (lambda d: dict(a_fp8=torch.zeros(32, 0, device=d).to(E4M3),
                        b_fp8=torch.zeros(48, 0, device=d).to(E4M3).t()), ValueError,
         "k = 0"),
    ],
)  # fmt: skip
def test_argument_errors(device, change, error, words):
    args = _bad(device, **change(device))
    before = args["out"].clone()
    with pytest.raises(error, match=words):
        ops.fp8_gemm_into_(**args)
    assert torch.equal(args["out"], before)
