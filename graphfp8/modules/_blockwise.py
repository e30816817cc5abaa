"""The linear GEMMs under Float8BlockScaling: a stateless autograd Function over the blockwise
quantizers and GEMM of graphfp8/ops/blockwise.py (docs/fp8.md, "Blockwise scaling").

Each operand is quantized along its own GEMM's K, at the GEMM, from its high-precision value:

    forward  y  (M, N) = x  @ w.T    x in 1x128 tiles along K      w in 128x128 blocks
    dgrad    dx (M, K) = dy @ w      dy in 1x128 tiles along N     w's blocks, transposed
    wgrad    dw (N, K) = dy.T @ x    dy.T in 1x128 tiles along M   x.T in 1x128 tiles along M

A 128x128 block is its own transpose's block, so the forward's w_fp8 serves dgrad too. A
blockwise FP8 primary weight (graphfp8.fp8.block_tensor) is read as stored: its blocks are what
the forward would quantize its master into (fp8/primary.py). The
forward saves x.T's tiles (the wgrad operand) and w's blocks, not x. Nothing carries across
calls: every scale is computed from the tensor being quantized, so a graph replays the whole
computation, scales included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.observe import observe_block
from graphfp8.modules._context import blockwise_recipe
from graphfp8.ops.blockwise import blockwise_gemm, quantize_blocks, quantize_tiles

__all__ = ["linear"]

_E4M3 = torch.float8_e4m3fn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or its blockwise FP8 form under an enabled Float8BlockScaling region.

    Args:
        x: (..., K) in the weight's dtype; weight: (N, K); bias: (N,) or None.

    Returns:
        (..., N) in x's dtype.
    """
    recipe = blockwise_recipe()
    if recipe is None:
        return F.linear(x, weight, bias)
    return _BlockwiseLinear.apply(x, weight, bias, recipe.power_2_scale)


class _BlockwiseLinear(torch.autograd.Function):
    """y = x @ w.T + b with the three GEMMs of the module docstring."""

    @staticmethod
    def forward(fn_ctx, x, weight, bias, power_2_scale: bool):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        x_fp8, x_scale_inv = quantize_tiles(x2, _E4M3, power_2_scale)
        if isinstance(weight, Float8BlockTensor):  # checked: modules/base._check_blockwise
            w_fp8, w_scale_inv = weight._data, weight._scale_inv
        else:
            w_fp8, w_scale_inv = quantize_blocks(weight, _E4M3, power_2_scale)
        # The numerics report (graphfp8/numerics_blockwise.py); nothing when not installed.
        observe_block(weight, "input", lambda: (x2, x_fp8, x_scale_inv, 1))
        observe_block(weight, "weight", lambda: (weight.detach(), w_fp8, w_scale_inv, 128))
        y = blockwise_gemm(x_fp8, x_scale_inv, w_fp8, w_scale_inv, x.dtype)
        if bias is not None:
            y = y + bias
        saved = (w_fp8, w_scale_inv)
        if weight.requires_grad:
            saved += quantize_tiles(x2.t(), _E4M3, power_2_scale)
        fn_ctx.save_for_backward(*saved)
        fn_ctx.power_2_scale, fn_ctx.x_shape, fn_ctx.weight = power_2_scale, x.shape, weight
        fn_ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(fn_ctx, dy):
        w_fp8, w_scale_inv, *x_t = fn_ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = fn_ctx.dtypes
        p2 = fn_ctx.power_2_scale
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if fn_ctx.needs_input_grad[0]:
            dy_fp8, dy_scale_inv = quantize_tiles(dy2, _E4M3, p2)
            observe_block(fn_ctx.weight, "grad_output", lambda: (dy2, dy_fp8, dy_scale_inv, 1))
            dx = blockwise_gemm(dy_fp8, dy_scale_inv, w_fp8.t().contiguous(),
                                w_scale_inv.t().contiguous(), x_dtype)  # fmt: skip
            dx = dx.reshape(fn_ctx.x_shape)
        if fn_ctx.needs_input_grad[1]:
            dy_t_fp8, dy_t_scale_inv = quantize_tiles(dy2.t(), _E4M3, p2)
            dw = blockwise_gemm(dy_t_fp8, dy_t_scale_inv, *x_t, w_dtype)
        if fn_ctx.needs_input_grad[2]:
            db = dy2.sum(0).to(b_dtype)
        return dx, dw, db, None
