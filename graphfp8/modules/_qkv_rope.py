"""The QKV projection and RoPE as one autograd Function (kernel switch ROPE_CAST_BWD, off by
default; docs/benchmarking.md, "Kernel switches"): the forward is the FP8
linear then RopeQKVParts' rotation, the same ops and bits; the backward casts the projection's
gradient to FP8 straight from dq, dk, dv (graphfp8.ops.rope_cast_transpose), so the fused
(B, S, (H + 2G) D) gradient that RopeQKVParts' backward writes and the cast reads never exists.

    unfused  dq, dk, dv --rope_fp8_backward--> dqkv (hp) --cast_transpose(_dbias)--> FP8, FP8^T
    fused    dq, dk, dv --rope_cast_transpose--> FP8, FP8^T (dbias)
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.fp8.observe import StatsSource
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.fp8.slots import BwdRole
from graphfp8.modules._functional import (
    GemmConfig,
    cast_input,
    dgrad_gemm,
    forward_gemm,
    save_weight,
    weight_t,
    wgrad_gemm,
)
from graphfp8.ops.switches import switch_on

__all__ = ["fp8_linear_rope", "rope_cast_on"]


def rope_cast_on() -> bool:
    """Whether the kernel switch ROPE_CAST_BWD is on (on every device: it chooses this path)."""
    return switch_on("ROPE_CAST_BWD")


def _aligned(g: torch.Tensor) -> torch.Tensor:
    """g contiguous at a 16-byte-aligned address (the CUDA kernel's vector loads)."""
    if g.is_contiguous() and g.data_ptr() % 16 == 0:
        return g
    return g.clone(memory_format=torch.contiguous_format)


class _FP8LinearRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight, bias, cos, sin, heads: tuple, cfg: GemmConfig,
                needs_grads: tuple):  # fmt: skip
        out_features, in_features = weight.shape
        b, s = inp.shape[:2]
        x_fp8, x_t_fp8, x_scale_inv = cast_input(inp, in_features, cfg, needs_grads[1])
        y = forward_gemm(x_fp8, x_scale_inv, weight, bias, cfg).view(b, s, out_features)
        save_weight(ctx, "w", cfg)
        ctx.save_for_backward(x_t_fp8, x_scale_inv, cos, sin)
        ctx.cfg, ctx.inp_shape, ctx.heads, ctx.needs_grads = cfg, inp.shape, heads, needs_grads
        ctx.has_bias, ctx.dtype = bias is not None, y.dtype
        h, g = heads
        out = ops.rope_qkv(y, cos, sin, h, num_kv_heads=g)
        parts = out.view(b, s, h + 2 * g, out_features // (h + 2 * g))
        return tuple(parts.split([h, g, g], dim=2))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cfg: GemmConfig = ctx.cfg
        x_t_fp8, x_scale_inv, cos, sin = ctx.saved_tensors
        (h, g), (needs_dgrad, needs_wgrad) = ctx.heads, ctx.needs_grads
        grads = [_aligned(t) if t is not None else None for t in (dq, dk, dv)]
        if any(t is None for t in grads):  # a part that reached no loss: a zero gradient
            ref = next(t for t in grads if t is not None)
            shapes = [(*ref.shape[:2], n, ref.shape[3]) for n in (h, g, g)]
            grads = [t if t is not None else ref.new_zeros(shape)
                     for t, shape in zip(grads, shapes, strict=True)]  # fmt: skip
        needs_dbias = ctx.has_bias and ctx.needs_input_grad[2]
        amax_pass = lambda q: ops.rope_amax_(grads, cos, sin, h, q.amax, g)  # noqa: E731
        quantizer = cfg.quantizer(BwdRole.GRAD_OUTPUT, amax_pass)
        dy_fp8, dy_t_fp8, dy_scale_inv, dbias = ops.rope_cast_transpose(
            grads, cos, sin, h, quantizer, needs_dbias, g
        )
        cfg.observe(BwdRole.GRAD_OUTPUT, lambda: StatsSource(
            "identity", ops.rope_fp8_backward(grads, None, cos, sin, ctx.dtype).flatten(0, 1)
        ))  # fmt: skip
        dx = dw = None
        if needs_dgrad:
            w_t, w_scale_inv = weight_t(ctx.w)
            dx = dgrad_gemm(dy_fp8, dy_scale_inv, w_t, w_scale_inv, ctx.dtype).view(ctx.inp_shape)
        dy_fp8 = None  # freed before the wgrad output is allocated
        if needs_wgrad:
            dw = wgrad_gemm(dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv, ctx.dtype, cfg)
        SCHEDULE.after_backward(cfg.backward_update)
        return dx, dw, dbias, None, None, None, None, None


def fp8_linear_rope(inp, weight, bias, cfg: GemmConfig, tables, heads: int, kv_heads: int):
    """The FP8 linear y = inp @ weight.T + bias of a fused QKV projection, then RoPE on its q and
    k heads, returned as RopeQKVParts returns them; its backward casts the gradient of y to FP8
    from dq, dk, dv in one kernel (graphfp8.ops.rope_cast_transpose).

    Args:
        inp: (batch, seq, K) Float8Tensor (the norm's FP8 output) or tensor of weight.dtype.
        weight: (W, K), W = (heads + 2 * kv_heads) * head_dim; bias: (W,) or None.
        cfg: the projection's GemmConfig (no fp8_output).
        tables: (cos, sin) float32 (>= seq, head_dim).
        heads, kv_heads: query and key/value heads.

    Returns:
        q (batch, seq, heads, head_dim), k, v (batch, seq, kv_heads, head_dim) of weight.dtype:
        views of one tensor, q and k rotated.
    """
    grad = torch.is_grad_enabled()
    needs = (grad and inp.requires_grad, grad and weight.requires_grad)
    return _FP8LinearRope.apply(inp, weight, bias, *tables, (heads, kv_heads), cfg, needs)
