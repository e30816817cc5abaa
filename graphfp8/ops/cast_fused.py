"""Typed wrappers of the fused cast-transposes: grad-output + dbias, GELU, dGELU + dbias."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["cast_transpose_dbias", "gelu_cast_transpose", "dgelu_cast_transpose_dbias"]

# (x_fp8 (rows, cols), x_t_fp8 (cols, rows), scale_inv (1,)): both layouts and their scale_inv.
CastTransposed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _outputs(x: torch.Tensor, fp8_dtype: torch.dtype, what: str) -> CastTransposed:
    """Fresh (out (rows, cols), out_t (cols, rows), scale_inv (1,)) for a 2-D x."""
    if x.dim() != 2:
        raise ValueError(f"graphfp8.{what}: argument 'x' must be 2-D, got {x.dim()}-D")
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    out_t = torch.empty((cols, rows), dtype=fp8_dtype, device=x.device)
    return out, out_t, torch.empty(1, dtype=torch.float32, device=x.device)


@wraps_op("cast_transpose_dbias")
def cast_transpose_dbias(
    dy: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scaled_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast-transposes a gradient to FP8 and sums it over rows, reading it once.

    Args:
        dy: (M, N), float32/bfloat16/float16, row-major contiguous.
        scale: (1,) float32: dy_fp8 = saturate(dy * scale).
        amax: (1,) float32, updated in place to max(amax, max|dy|) (NaNs ignored).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        scaled_max: optional (1,) float32: current scaling computed by the cast (amax is then
            the slot's H[0], read and reset; graphfp8.ops.cast_to_fp8).

    Returns:
        (dy_fp8 (M, N), dy_t_fp8 (N, M), scale_inv (1,) float32, dbias (N,) in dy.dtype), where
        dbias = dy.sum(0) accumulated in fp32.
    """
    out, out_t, scale_inv = _outputs(dy, fp8_dtype, "cast_transpose_dbias")
    dbias = torch.empty(dy.shape[1], dtype=dy.dtype, device=dy.device)
    ops.cast_transpose_dbias(dy, scale, out, out_t, scale_inv, amax, dbias, scaled_max)
    return out, out_t, scale_inv, dbias


@wraps_op("gelu_cast_transpose")
def gelu_cast_transpose(
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scaled_max: torch.Tensor | None = None,
) -> CastTransposed:
    """FP8 cast-transpose of gelu(x) (tanh approximation), without writing gelu(x) itself.

    gelu(x) is computed in fp32 and rounded to x.dtype before it is scaled and folded into amax,
    so the result is that of F.gelu(x, approximate="tanh") followed by cast_transpose.

    Args:
        x: (M, F), float32/bfloat16/float16, row-major contiguous: the GELU input.
        scale, amax, fp8_dtype, scaled_max: as in `cast_transpose_dbias` (amax of gelu(x)).

    Returns:
        (y_fp8 (M, F), y_t_fp8 (F, M), scale_inv (1,) float32) of y = gelu(x).
    """
    out, out_t, scale_inv = _outputs(x, fp8_dtype, "gelu_cast_transpose")
    ops.gelu_cast_transpose(x, scale, out, out_t, scale_inv, amax, scaled_max)
    return out, out_t, scale_inv


@wraps_op("dgelu_cast_transpose_dbias")
def dgelu_cast_transpose_dbias(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    scaled_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GELU backward fused with the FP8 cast-transpose of its result and its row sum.

    dx = dy * gelu'(x) is computed in fp32 and rounded to dy.dtype, as torch's gelu_backward
    (approximate="tanh") stores it; dx itself is never written.

    Args:
        dy: (M, F), float32/bfloat16/float16, row-major contiguous: grad of the GELU output.
        x: (M, F), dy's dtype, contiguous: the GELU input saved by the forward.
        scale, amax, fp8_dtype, scaled_max: as in `cast_transpose_dbias` (amax of dx).

    Returns:
        (dx_fp8 (M, F), dx_t_fp8 (F, M), scale_inv (1,) float32, dbias (F,) in dy.dtype), where
        dbias = dx.sum(0) accumulated in fp32.
    """
    out, out_t, scale_inv = _outputs(dy, fp8_dtype, "dgelu_cast_transpose_dbias")
    dbias = torch.empty(dy.shape[1], dtype=dy.dtype, device=dy.device)
    ops.dgelu_cast_transpose_dbias(dy, x, scale, out, out_t, scale_inv, amax, dbias, scaled_max)
    return out, out_t, scale_inv, dbias
