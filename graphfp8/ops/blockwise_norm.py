"""LayerNorm / RMSNorm with the output quantized blockwise in one op (csrc/blockwise_norm.h):
y = norm(z) rounded to x's dtype, in 1x128 tiles along hidden and, with transpose, y.T in 1x128
tiles along the rows (the wgrad operand), without y written to memory on CUDA.

    z = x (or x + residual, rounded); y = ((z - mu) * rsigma) * g (+ beta), g = gamma (+ 1)
    out, scale_inv = tiles of y       out_t, scale_inv_t = tiles of y.T

Bit for bit the norm kernel's high-precision output (graphfp8.ops.norm, hp_out) quantized by
graphfp8.ops.blockwise_quantize; the twin is graphfp8.reference.blockwise_norm (docs/fp8.md,
"Blockwise scaling").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from graphfp8.ops._lib import ops, wraps_op
from graphfp8.ops.blockwise_fused import tile_outputs

__all__ = ["BlockNorm", "blockwise_norm"]


class BlockNorm(NamedTuple):
    """blockwise_norm's outputs.

    out: (rows, hidden) FP8; scale_inv: (rows, ceil(hidden / 128)) float32; out_t: (hidden,
    rows) FP8 or None; scale_inv_t: (hidden, ceil(rows / 128)) float32 or None; mu: (rows,)
    float32 (LayerNorm) or None; rsigma: (rows,) float32; residual_out: z (rows, hidden) in x's
    dtype, or None.
    """

    out: torch.Tensor
    scale_inv: torch.Tensor
    out_t: torch.Tensor | None
    scale_inv_t: torch.Tensor | None
    mu: torch.Tensor | None
    rsigma: torch.Tensor
    residual_out: torch.Tensor | None


@wraps_op("blockwise_norm")
def blockwise_norm(
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    eps: float,
    *,
    zero_centered_gamma: bool = False,
    transpose: bool = False,
    residual: torch.Tensor | None = None,
    power_2_scale: bool = True,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
) -> BlockNorm:
    """LayerNorm (beta given) or RMSNorm (beta None) of each row of x, quantized in 1x128 tiles.

    Args:
        x: (rows, hidden) float32/bfloat16/float16, contiguous.
        gamma, beta: (hidden,) in x's dtype; beta None: RMSNorm.
        eps: added to the variance (mean square).
        zero_centered_gamma: the weight is 1 + gamma.
        transpose: also write y.T's tiles (the layout the weight-gradient GEMM reads).
        residual: optional (rows, hidden) in x's dtype: normalize z = x + residual (rounded).
        power_2_scale: tile scales floored to powers of 2 (the recipe's default).
        fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.

    Returns:
        BlockNorm.
    """
    if x.dim() != 2:
        raise ValueError(f"graphfp8.blockwise_norm: argument 'x' must be 2-D, got {x.dim()}-D")
    rows, hidden = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    o = BlockNorm(
        **tile_outputs(rows, hidden, fp8_dtype, x.device, transpose),
        mu=torch.empty(rows, **f32) if beta is not None else None,
        rsigma=torch.empty(rows, **f32),
        residual_out=torch.empty_like(x) if residual is not None else None,
    )
    ops.blockwise_norm(x, gamma, beta, eps, zero_centered_gamma, o.out, o.scale_inv, o.out_t,
                       o.scale_inv_t, o.mu, o.rsigma, residual, o.residual_out,
                       power_2_scale)  # fmt: skip
    return o
