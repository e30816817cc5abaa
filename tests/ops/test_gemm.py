"""The FP8 GEMM wrapper: numerics against fp32 on the dequantized operands, and the CUDA rules
enforced on every device."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops
from graphfp8.testing import TOLERANCES

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _quantized(rows, cols, dtype, device):
    # Operands of std cols**-1/4 make the GEMM outputs O(1), where the absolute tolerance applies.
    x = torch.randn(rows, cols, device=device) * cols**-0.25
    amax = torch.zeros(1, device=device)
    amax_guess = 4.0 * cols**-0.25
    scale = torch.full((1,), (448.0 if dtype == E4M3 else 57344.0) / amax_guess, device=device)
    x_fp8, scale_inv = ops.cast_to_fp8(x, scale, amax, dtype)
    return x_fp8, scale_inv


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("mkn", [(32, 64, 48), (7, 16, 16), (128, 256, 96)])
def test_gemm_matches_fp32_of_dequantized(device, out_dtype, dtypes, mkn):
    m, k, n = mkn
    a, sa = _quantized(m, k, dtypes[0], device)
    b_rows, sb = _quantized(n, k, dtypes[1], device)
    out = ops.fp8_gemm(a, sa, b_rows.t(), sb, out_dtype)
    ref = (a.float() * sa) @ (b_rows.float() * sb).t()
    tol = TOLERANCES[out_dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_gemm_fused_bias(device):
    a, sa = _quantized(32, 64, E4M3, device)
    b, sb = _quantized(48, 64, E4M3, device)
    bias = torch.randn(48, device=device, dtype=torch.bfloat16)
    out = ops.fp8_gemm(a, sa, b.t(), sb, torch.bfloat16, bias=bias)
    ref = (a.float() * sa) @ (b.float() * sb).t() + bias.float()
    torch.testing.assert_close(out.float(), ref, rtol=7e-2, atol=7e-2)


def test_gemm_rules():
    a, sa = _quantized(32, 64, E4M3, "cpu")
    b, sb = _quantized(48, 64, E4M3, "cpu")
    with pytest.raises(ValueError, match="multiples of 16, got k=60, n=48"):
        ops.fp8_gemm(a[:, :60].contiguous(), sa, b[:, :60].contiguous().t(), sb, torch.float32)
    with pytest.raises(ValueError, match="multiples of 16, got k=64, n=40"):
        ops.fp8_gemm(a, sa, b[:40].t(), sb, torch.float32)
    with pytest.raises(TypeError, match="E5M2 x E5M2"):
        ops.fp8_gemm(
            a.view(torch.uint8).view(E5M2),
            sa,
            b.view(torch.uint8).view(E5M2).t(),
            sb,
            torch.float32,
        )
    with pytest.raises(ValueError, match="column-major"):
        ops.fp8_gemm(a, sa, b.t().contiguous(), sb, torch.float32)
    with pytest.raises(ValueError, match="row-major"):
        ops.fp8_gemm(b.t().contiguous().t(), sb, a.t(), sa, torch.float32)
    with pytest.raises(ValueError, match="fused bias needs a bf16/fp16 output"):
        ops.fp8_gemm(a, sa, b.t(), sb, torch.float32, bias=torch.zeros(48))
    with pytest.raises(ValueError, match="cannot be multiplied"):
        ops.fp8_gemm(a, sa, _quantized(48, 32, E4M3, "cpu")[0].t(), sb, torch.float32)
    with pytest.raises(TypeError, match="both operands must be FP8"):
        ops.fp8_gemm(a.float(), sa, b.t(), sb, torch.float32)


def test_gemm_needs_16_byte_aligned_operands_and_scales():
    """cuBLASLt's FP8 GEMMs answer CUBLAS_STATUS_NOT_SUPPORTED for a matrix or scale pointer
    that is not 16-byte aligned (FP8 attention's O scale_inv, a view 4 bytes into a pair, did
    under fp8_mha): every device raises before running."""
    a, sa = _quantized(32, 64, E4M3, "cpu")
    b, sb = _quantized(48, 64, E4M3, "cpu")
    pair = torch.ones(2)
    with pytest.raises(ValueError, match="'a_scale_inv' must start at a 16-byte aligned"):
        ops.fp8_gemm(a, pair[1:2], b.t(), sb, torch.float32)
    with pytest.raises(ValueError, match="'b_scale_inv' must start at a 16-byte aligned"):
        ops.fp8_gemm(a, sa, b.t(), pair[1:2], torch.float32)
    shifted = torch.empty(8 + a.numel(), dtype=E4M3)[8:].view(a.shape)
    shifted.copy_(a)
    with pytest.raises(ValueError, match="'a_fp8' must start at a 16-byte aligned"):
        ops.fp8_gemm(shifted, sa, b.t(), sb, torch.float32)
    spaced = torch.ones(2, 4)[:, 0]  # elements 16 bytes apart: each one aligned
    ops.fp8_gemm(a, spaced[1:2], b.t(), spaced[0:1], torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cublaslt_rejects_a_misaligned_scale():
    """The GPU rule the check above stands for: torch._scaled_mm itself, on the shape and
    options of the attention projection that failed (256^3, E4M3, bf16 out with a bias, fast
    accumulation), runs with an aligned scale and not with one 4 bytes in."""
    a, _ = _quantized(256, 256, E4M3, "cuda")
    b, _ = _quantized(256, 256, E4M3, "cuda")
    bias = torch.zeros(256, dtype=torch.bfloat16, device="cuda")
    scales = torch.ones(2, 4, device="cuda")

    def run(scale_a):
        return torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scales[0, :1], bias=bias,
                                out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip

    run(scales[1, :1])
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="CUBLAS_STATUS_NOT_SUPPORTED"):
        run(scales[1, 1:2])
        torch.cuda.synchronize()
