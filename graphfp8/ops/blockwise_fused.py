"""The fused blockwise FP8 quantizer (csrc/blockwise.h: one pass per operand) and the switch
that chooses it over graphfp8/ops/blockwise.py's torch ops, its twin.

GRAPHFP8_BLOCKWISE_KERNELS, read at import (`KERNELS.mode` may be changed at run time, as
`blockwise_kernels` does for one block):

    unset   the fused kernel on both devices (its CUDA tests passed on the H200, 2026-12-02:
            docs/benchmarking.md, "Kernel switches")
    fused   the fused kernel on both devices
    torch   the torch ops on both
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["KERNELS", "MODES", "blockwise_kernels", "blockwise_quantize", "fused_on",
           "tile_outputs"]  # fmt: skip

MODES = ("", "fused", "torch")
TILE = 128


class _Kernels:
    """The switch's value: "" (the default: fused), "fused" or "torch"."""

    def __init__(self) -> None:
        self.mode = os.environ.get("GRAPHFP8_BLOCKWISE_KERNELS", "")


KERNELS = _Kernels()


def fused_on(device: torch.device) -> bool:
    """Whether blockwise quantization on `device` runs the fused kernel (module docstring; the
    same answer on every device since the CUDA kernel's H200 run)."""
    mode = KERNELS.mode
    if mode not in MODES:
        raise ValueError(
            f"GRAPHFP8_BLOCKWISE_KERNELS={mode!r}: give 'fused', 'torch' or leave it unset "
            "(the fused kernel)"
        )
    return mode in ("", "fused")


@contextlib.contextmanager
def blockwise_kernels(mode: str) -> Iterator[None]:
    """Runs the block with GRAPHFP8_BLOCKWISE_KERNELS set to `mode` ("fused", "torch" or "")."""
    if mode not in MODES:
        raise ValueError(f"blockwise_kernels: mode must be one of {MODES}, got {mode!r}")
    before, KERNELS.mode = KERNELS.mode, mode
    try:
        yield
    finally:
        KERNELS.mode = before


def _scale_shapes(rows: int, cols: int, block_rows: int) -> tuple[tuple, tuple]:
    """(scale_inv, scale_inv_t) shapes of x (rows, cols) in tiles of block_rows x 128."""
    rt, ct = -(-rows // TILE), -(-cols // TILE)
    if block_rows == 1:
        return (rows, ct), (cols, rt)
    return (rt, ct), (ct, rt)


def tile_outputs(rows: int, cols: int, fp8_dtype: torch.dtype, device, transpose: bool) -> dict:
    """Empty 1x128 tiles of a (rows, cols) result for a kernel to write: out (rows, cols)
    fp8_dtype and scale_inv (rows, ceil(cols / 128)) float32; with transpose also out_t
    (cols, rows) and scale_inv_t (cols, ceil(rows / 128)), else None."""
    (s, s_t), f32 = _scale_shapes(rows, cols, 1), dict(dtype=torch.float32, device=device)
    return dict(
        out=torch.empty(rows, cols, dtype=fp8_dtype, device=device),
        scale_inv=torch.empty(s, **f32),
        out_t=torch.empty(cols, rows, dtype=fp8_dtype, device=device) if transpose else None,
        scale_inv_t=torch.empty(s_t, **f32) if transpose else None,
    )


@wraps_op("blockwise_quantize")
def blockwise_quantize(
    x: torch.Tensor,
    block_rows: int = 1,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    power_2_scale: bool = True,
    *,
    transpose: bool = False,
    out: tuple[torch.Tensor, ...] | None = None,
    noop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Blockwise FP8 quantization of x in one pass (docs/fp8.md, "Blockwise scaling").

    Args:
        x: (R, C) float32/bfloat16/float16, contiguous.
        block_rows: 1 (1x128 tiles along C) or 128 (128x128 blocks).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        power_2_scale: scales floored to powers of 2 (the recipe's default).
        transpose: also write the layout of x.T: for tiles x.T's own 1x128 tiles (along R), for
            blocks the transposed bytes and block scales.
        out: optional destinations (x_fp8, scale_inv[, x_t_fp8, scale_inv_t]) of the shapes
            below; allocated when None.
        noop: optional (1,) float32 flag; when it holds 1 the kernel writes nothing.

    Returns:
        (x_fp8 (R, C), scale_inv) and with transpose (x_t_fp8 (C, R), scale_inv_t) too; scales
        float32: tiles (R, ceil(C/128)) and (C, ceil(R/128)); blocks (ceil(R/128), ceil(C/128))
        and its transpose.
    """
    if x.dim() != 2:
        raise ValueError(f"graphfp8.blockwise_quantize: argument 'x' must be 2-D, got {x.dim()}-D")
    if out is None:
        rows, cols = x.shape
        shape, shape_t = _scale_shapes(rows, cols, block_rows)
        f32 = dict(dtype=torch.float32, device=x.device)
        out = (torch.empty((rows, cols), dtype=fp8_dtype, device=x.device),
               torch.empty(shape, **f32))  # fmt: skip
        if transpose:
            out += (torch.empty((cols, rows), dtype=fp8_dtype, device=x.device),
                    torch.empty(shape_t, **f32))  # fmt: skip
    out_t, scale_inv_t = out[2:] if len(out) == 4 else (None, None)
    ops.blockwise_quantize(x, out[0], out[1], out_t, scale_inv_t, block_rows, power_2_scale, noop)
    return out
