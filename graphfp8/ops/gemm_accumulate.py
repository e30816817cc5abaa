"""Typed wrapper of the FP8 GEMM that accumulates into an fp32 output in place (cuBLASLt, beta 1):
the wgrad GEMM of fuse_wgrad_accumulation (docs/fp8.md, "Weight-gradient accumulation")."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["fp8_gemm_accumulate_"]


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
    if b_fp8.dim() != 2 or not b_fp8.t().is_contiguous():
        raise ValueError(
            "graphfp8.fp8_gemm_accumulate_: 'b_fp8' must be a 2-D column-major matrix "
            f"(b_fp8.t() contiguous), got shape {tuple(b_fp8.shape)}, strides {b_fp8.stride()}"
        )
    ops.fp8_gemm_accumulate(a_fp8, a_scale_inv, b_fp8.t(), b_scale_inv, out)
    return out
