"""Typed wrappers of the FP8 cast kernels: cast_to_fp8 and cast_transpose."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["cast_to_fp8", "cast_transpose"]


def _scale_inv_buffer(x: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=x.device) if scale_inv is None else scale_inv


@wraps_op("cast_to_fp8")
def cast_to_fp8(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scaled_max: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scale_inv: torch.Tensor | None = None,
    noop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Casts x to FP8 in one pass, folding max|x| into `amax` and writing 1/scale to `scale_inv`.

    Args:
        x: (...), float32/bfloat16/float16, contiguous.
        scale: (1,) float32, the quantization scale: x_fp8 = saturate(x * scale).
        amax: (1,) float32, updated in place to max(amax, max|x|) (NaNs in x are ignored).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        scaled_max: optional (1,) float32, the slot's fp8_max * 2**-margin: current scaling
            computed by the cast (docs/fp8.md, "Current scaling"). `amax` is then the slot's
            H[0] left by an amax pass: the cast sets `scale` from it on the device (the one-slot
            update of the delayed-scaling math), resets it to 0 and casts with the new scale,
            folding its own amax nowhere; the update runs even when `noop` skips the cast.
        out: optional (...) fp8_dtype destination, allocated when None.
        scale_inv: optional (1,) float32 destination for 1/scale, allocated when None.
        noop: optional (1,) float32 flag; when it holds 1 the kernel writes nothing.

    Returns:
        (x_fp8, scale_inv): x_fp8 (...) fp8_dtype and scale_inv (1,) float32.
    """
    out = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if out is None else out
    scale_inv = _scale_inv_buffer(x, scale_inv)
    ops.cast_to_fp8(x, scale, out, scale_inv, amax, noop, scaled_max)
    return out, scale_inv


@wraps_op("cast_transpose")
def cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scaled_max: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    out_t: torch.Tensor | None = None,
    scale_inv: torch.Tensor | None = None,
    noop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Casts a 2-D x to FP8 and writes both layouts in one pass (amax and scale_inv fused).

    Args:
        x: (rows, cols), float32/bfloat16/float16, row-major contiguous.
        scale, amax, fp8_dtype, scaled_max, scale_inv, noop: as in `cast_to_fp8`.
        out: optional (rows, cols) fp8_dtype destination.
        out_t: optional (cols, rows) fp8_dtype destination for the transpose.

    Returns:
        (x_fp8, x_t_fp8, scale_inv): (rows, cols) and (cols, rows) fp8_dtype, (1,) float32.
    """
    if x.dim() != 2:
        raise ValueError(f"graphfp8.cast_transpose: argument 'x' must be 2-D, got {x.dim()}-D")
    rows, cols = x.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    if out_t is None:
        out_t = torch.empty((cols, rows), dtype=fp8_dtype, device=x.device)
    scale_inv = _scale_inv_buffer(x, scale_inv)
    ops.cast_transpose(x, scale, out, out_t, scale_inv, amax, noop, scaled_max)
    return out, out_t, scale_inv
