"""Typed wrappers of the FP8 GEMM that accumulates into its output in place (cuBLASLt, C = D):
the wgrad GEMM of fuse_wgrad_accumulation (fp32, beta 1) and of WGRAD_INTO_GRAD (the bf16 .grad,
alpha and beta read from device memory; docs/fp8.md, "Weight-gradient accumulation")."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["fp8_gemm_accumulate_", "fp8_gemm_into_"]


@wraps_op("fp8_gemm_accumulate")
def fp8_gemm_accumulate_(
    a_fp8: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """out += (a_fp8 * a_scale_inv) @ (b_fp8 * b_scale_inv), accumulated in fp32, in place.

    On CUDA one cuBLASLt FP8 GEMM with C = D = out and beta = 1 (no separate add pass); on the
    CPU each operand decoded and scaled in fp32, each dot product summed in fp32 and added.

    Args:
        a_fp8: (m, k) FP8, row-major contiguous.
        a_scale_inv: (1,) float32, 16-byte aligned.
        b_fp8: (k, n) FP8, column-major (b_fp8.t() contiguous), as graphfp8.fp8_gemm takes it;
            not E5M2 when a_fp8 is E5M2.
        b_scale_inv: (1,) float32, 16-byte aligned.
        out: (m, n) float32, contiguous: read and written.

    Returns:
        out.
    """
    _check_column_major("fp8_gemm_accumulate_", b_fp8)
    ops.fp8_gemm_accumulate(a_fp8, a_scale_inv, b_fp8.t(), b_scale_inv, out)
    return out


@wraps_op("fp8_gemm_into")
def fp8_gemm_into_(
    a_fp8: torch.Tensor,
    a_scale_inv: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale_inv: torch.Tensor,
    out: torch.Tensor,
    alpha_beta: torch.Tensor,
) -> torch.Tensor:
    """out = alpha * (a_fp8 * a_scale_inv) @ (b_fp8 * b_scale_inv) + beta * out, the sum in fp32
    rounded once to out's dtype, in place; beta = 0 ignores out's values (NaN included).

    On CUDA one cuBLASLt FP8 GEMM with C = D = out that reads alpha and beta from device memory
    when it runs (CUBLASLT_POINTER_MODE_DEVICE): one captured graph writes the product on the
    first microbatch of a step (beta 0) and accumulates on the others (beta 1). On the CPU each
    operand decoded and scaled in fp32, each dot product summed in k order in fp32, then the
    epilogue in fp32.

    Args:
        a_fp8: (m, k) FP8, row-major contiguous; k > 0.
        a_scale_inv: (1,) float32, 16-byte aligned.
        b_fp8: (k, n) FP8, column-major (b_fp8.t() contiguous); not E5M2 when a_fp8 is E5M2.
        b_scale_inv: (1,) float32, 16-byte aligned.
        out: (m, n) float32, bfloat16 or float16, contiguous, 16-byte aligned.
        alpha_beta: (2,) float32 (alpha, beta) on out's device.

    Returns:
        out.
    """
    _check_column_major("fp8_gemm_into_", b_fp8)
    ops.fp8_gemm_into(a_fp8, a_scale_inv, b_fp8.t(), b_scale_inv, out, alpha_beta)
    return out


def _check_column_major(name: str, b_fp8: torch.Tensor) -> None:
    if b_fp8.dim() != 2 or not b_fp8.t().is_contiguous():
        raise ValueError(
            f"graphfp8.{name}: 'b_fp8' must be a 2-D column-major matrix "
            f"(b_fp8.t() contiguous), got shape {tuple(b_fp8.shape)}, strides {b_fp8.stride()}"
        )
