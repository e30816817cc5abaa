"""Typed wrapper of the FP8 transpose kernel."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["fp8_transpose"]


@wraps_op("fp8_transpose")
def fp8_transpose(
    x_fp8: torch.Tensor, *, out_t: torch.Tensor | None = None, noop: torch.Tensor | None = None
) -> torch.Tensor:
    """Transposes FP8 data into a row-major buffer.

    Args:
        x_fp8: (rows, cols), float8_e4m3fn or float8_e5m2, row-major contiguous.
        out_t: optional (cols, rows) destination of the same dtype, allocated when None.
        noop: optional (1,) float32 flag; when it holds 1 the kernel writes nothing.

    Returns:
        out_t: (cols, rows), the dtype of x_fp8.
    """
    if x_fp8.dim() != 2:
        raise ValueError(f"graphfp8.fp8_transpose: argument 'x' must be 2-D, got {x_fp8.dim()}-D")
    if out_t is None:
        out_t = torch.empty(
            (x_fp8.shape[1], x_fp8.shape[0]), dtype=x_fp8.dtype, device=x_fp8.device
        )
    ops.fp8_transpose(x_fp8, out_t, noop)
    return out_t
