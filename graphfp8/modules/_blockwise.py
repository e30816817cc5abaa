"""The linear GEMMs under Float8BlockScaling: a stateless autograd Function over the blockwise
quantizers and GEMM of graphfp8/ops/blockwise.py (docs/fp8.md, "Blockwise scaling").

Each operand is quantized along its own GEMM's K, at the GEMM, from its high-precision value:

    forward  y  (M, N) = x  @ w.T    x in 1x128 tiles along K      w in 128x128 blocks
    dgrad    dx (M, K) = dy @ w      dy in 1x128 tiles along N     w's blocks, transposed
    wgrad    dw (N, K) = dy.T @ x    dy.T in 1x128 tiles along M   x.T in 1x128 tiles along M

A 128x128 block is its own transpose's block: the weight's quantization writes w's blocks and
their transpose (the dgrad operand) in one pass; x and dy are quantized in both their layouts
from one read each (graphfp8/ops/blockwise.py). The forward saves x.T's tiles (the wgrad
operand) and w.T's blocks, not x. Every scale is computed from the tensor being quantized, so a
graph replays the whole computation, scales included. The weight's blocks live in the module's
weight cache when a BlockWeight is given (modules/_context.blockwise_weights): quantized there
or reused as is_first_microbatch or the graph's flag says (the same bytes from the same weights).
A blockwise FP8 primary weight (graphfp8.fp8.block_tensor) is read as stored, with no cache: its
blocks are what the forward would quantize its master into (fp8/primary.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.observe import observe_block
from graphfp8.fp8.weight_cache import BlockWeight
from graphfp8.modules._context import blockwise_recipe
from graphfp8.ops.blockwise import TILE, blockwise_gemm, quantize

__all__ = ["hp_or_blockwise", "linear"]

_E4M3 = torch.float8_e4m3fn


def hp_or_blockwise(cfgs) -> bool:
    """Whether a layer's FP8 preamble (FP8Module._fp8_forward_configs) chose the high-precision
    path (None) or blockwise FP8 (a list of BlockWeight or None), not per-tensor GEMM configs."""
    return cfgs is None or all(c is None or isinstance(c, BlockWeight) for c in cfgs)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           cfgs: list | None = None, gemm: int = 0) -> torch.Tensor:  # fmt: skip
    """F.linear, or its blockwise FP8 form under an enabled Float8BlockScaling region.

    Args:
        x: (..., K) in the weight's dtype; weight: (N, K); bias: (N,) or None.
        cfgs, gemm: the layer's BlockWeights (None: the weight quantized in this call) and
            which of them is this weight's.

    Returns:
        (..., N) in x's dtype.
    """
    recipe = blockwise_recipe()
    if recipe is None:
        return F.linear(x, weight, bias)
    block = None if cfgs is None else cfgs[gemm]
    return _BlockwiseLinear.apply(x, weight, bias, recipe.power_2_scale, block)


def _weight_blocks(weight, block: BlockWeight | None, p2: bool, needs_dgrad: bool) -> tuple:
    """(w_fp8, scale_inv, w_t_fp8, scale_inv_t) of the weight's 128x128 blocks: the cache's
    (quantized into it first when the call casts; the transpose None when the module caches
    none), or quantized now (the transpose only for a dgrad); a blockwise FP8 primary weight's
    stored blocks (their transpose made at the dgrad)."""
    if isinstance(weight, Float8BlockTensor):  # checked: modules/base._check_blockwise
        return weight._data, weight._scale_inv, None, None
    if block is None:
        out = quantize(weight, TILE, _E4M3, p2, transpose=needs_dgrad)
    else:
        out = block.workspace.buffers
        if block.cast:
            quantize(weight, TILE, _E4M3, p2, transpose=len(out) == 4, out=out, noop=block.flag)
    return out if len(out) == 4 else (*out, None, None)


def _transposed(w_blocks: tuple) -> tuple:
    """The dgrad operand (w_t_fp8 (K, N), scale_inv_t) of _weight_blocks' result: its
    transpose, or one made now (the same bytes) when the cache keeps none."""
    w_fp8, w_scale_inv, w_t, w_t_scale_inv = w_blocks
    if w_t is None:
        return w_fp8.t().contiguous(), w_scale_inv.t().contiguous()
    return w_t, w_t_scale_inv


class _BlockwiseLinear(torch.autograd.Function):
    """y = x @ w.T + b with the three GEMMs of the module docstring."""

    @staticmethod
    def forward(fn_ctx, x, weight, bias, power_2_scale: bool, block: BlockWeight | None):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        needs_dgrad, needs_wgrad = fn_ctx.needs_input_grad[:2]
        x_fp8, x_scale_inv, *x_t = quantize(x2, 1, _E4M3, power_2_scale, transpose=needs_wgrad)
        w_blocks = _weight_blocks(weight, block, power_2_scale, needs_dgrad)
        # The numerics report (graphfp8/numerics_blockwise.py); nothing when not installed.
        observe_block(weight, "input", lambda: (x2, x_fp8, x_scale_inv, 1))
        observe_block(weight, "weight", lambda: (weight.detach(), *w_blocks[:2], 128))
        y = blockwise_gemm(x_fp8, x_scale_inv, *w_blocks[:2], x.dtype)
        if bias is not None:
            y = y + bias
        fn_ctx.save_for_backward(*x_t)
        # The weight's blocks may be the cache's, rewritten in place by later casts of the same
        # weights (the same bytes): kept out of save_for_backward's version checks, as the
        # per-tensor path keeps its workspaces (modules/_functional.py, save_weight).
        fn_ctx.w_blocks = w_blocks if needs_dgrad else None
        fn_ctx.power_2_scale, fn_ctx.x_shape, fn_ctx.weight = power_2_scale, x.shape, weight
        fn_ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(fn_ctx, dy):
        x_t = fn_ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = fn_ctx.dtypes
        needs_dgrad, needs_wgrad, needs_dbias = fn_ctx.needs_input_grad[:3]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if needs_dgrad or needs_wgrad:
            # dy's tiles along N (dgrad) and dy.T's along M (wgrad), from one read when both.
            dy_q = quantize(dy2, 1, _E4M3, fn_ctx.power_2_scale, transpose=needs_wgrad)
        if needs_dgrad:
            observe_block(fn_ctx.weight, "grad_output", lambda: (dy2, *dy_q[:2], 1))
            w_t = _transposed(fn_ctx.w_blocks)
            dx = blockwise_gemm(*dy_q[:2], *w_t, x_dtype).reshape(fn_ctx.x_shape)
        if needs_wgrad:
            dw = blockwise_gemm(*dy_q[2:], *x_t, w_dtype)
        if needs_dbias:
            db = dy2.sum(0).to(b_dtype)
        return dx, dw, db, None, None
