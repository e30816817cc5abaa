"""Typed wrapper of the FP8 dequantize kernel."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["dequantize"]


@wraps_op("dequantize")
def dequantize(
    x_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns x_fp8 * scale_inv in a high-precision dtype.

    Args:
        x_fp8: (...), float8_e4m3fn or float8_e5m2, contiguous.
        scale_inv: (1,) float32.
        dtype: float32, bfloat16 or float16 (ignored when `out` is given).
        out: optional (...) destination.

    Returns:
        (...) tensor of `dtype`.
    """
    out = torch.empty(x_fp8.shape, dtype=dtype, device=x_fp8.device) if out is None else out
    ops.dequantize(x_fp8, scale_inv, out)
    return out
