"""The MLP activations with the output quantized blockwise in one op (csrc/blockwise_act.h):
a = act(x) rounded to x's dtype, in 1x128 tiles along its columns and, with transpose, a.T in
1x128 tiles along the rows (the wgrad operand), without a written to memory on CUDA.

    gelu    x (rows, F)                 a = gelu_tanh(x)      (the GELU cast kernels' value)
    swiglu  x = [g | u] (rows, 2 F)     a = silu(g) * u       (glu_cast_transpose's value)
    geglu   x = [g | u] (rows, 2 F)     a = gelu_tanh(g) * u
    out, scale_inv = tiles of a         out_t, scale_inv_t = tiles of a.T

Bit for bit the fused per-tensor kernels' activation (gelu_cast_transpose, glu_cast_transpose)
rounded to x's dtype and quantized by graphfp8.ops.blockwise_quantize; the twin is
graphfp8.reference_blockwise.blockwise_act (docs/fp8.md, "Blockwise scaling").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphfp8.ops._lib import ops, wraps_op
from graphfp8.ops.blockwise_fused import tile_outputs

__all__ = ["BLOCK_ACTIVATIONS", "BlockAct", "blockwise_act"]

BLOCK_ACTIVATIONS = ("gelu", "swiglu", "geglu")


class BlockAct(NamedTuple):
    """blockwise_act's outputs.

    out: (rows, F) FP8; scale_inv: (rows, ceil(F / 128)) float32; out_t: (F, rows) FP8 or None;
    scale_inv_t: (F, ceil(rows / 128)) float32 or None.
    """

    out: torch.Tensor
    scale_inv: torch.Tensor
    out_t: torch.Tensor | None
    scale_inv_t: torch.Tensor | None


@wraps_op("blockwise_act")
def blockwise_act(
    x: torch.Tensor,
    activation: str,
    *,
    transpose: bool = False,
    power_2_scale: bool = True,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> BlockAct:
    """The activation of each row of x, quantized in 1x128 tiles.

    Args:
        x: (rows, F) for "gelu", (rows, 2 F) = [g | u] for "swiglu" and "geglu" (fc1's output,
            the gate first); float32/bfloat16/float16, contiguous.
        activation: "gelu" (tanh approximation), "swiglu" or "geglu".
        transpose: also write a.T's tiles (the layout the weight-gradient GEMM reads).
        power_2_scale: tile scales floored to powers of 2 (the recipe's default).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        BlockAct.
    """
    if activation not in BLOCK_ACTIVATIONS:
        raise ValueError(f"graphfp8.blockwise_act: activation must be one of "
                         f"{BLOCK_ACTIVATIONS}, got {activation!r}")  # fmt: skip
    if x.dim() != 2:
        raise ValueError(f"graphfp8.blockwise_act: argument 'x' must be 2-D, got {x.dim()}-D")
    rows, f = x.shape[0], x.shape[1] // (1 if activation == "gelu" else 2)
    o = BlockAct(**tile_outputs(rows, f, fp8_dtype, x.device, transpose))
    ops.blockwise_act(x, activation, o.out, o.scale_inv, o.out_t, o.scale_inv_t, power_2_scale)
    return o
