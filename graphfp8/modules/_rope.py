"""Rotary position embedding tables and the high-precision RoPE autograd Function (the bf16
attention path; FP8 attention fuses RoPE into its casts, graphfp8.ops.rope_fp8)."""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.ops.switches import switch_on

__all__ = ["RopeQKV", "RopeQKVParts", "rope_parts_backward", "rope_tables"]


def rope_parts_backward(device: torch.device) -> bool:
    """Whether RoPE's backward on `device` reads dq, dk, dv in one kernel (RopeQKVParts): always
    on the CPU, on CUDA under the kernel switch ROPE_PARTS_BWD (on by default)."""
    return device.type == "cpu" or switch_on("ROPE_PARTS_BWD")


def rope_tables(max_seq_len: int, head_dim: int, base: float, dtype, device):
    """cos, sin: (max_seq_len, head_dim) in `dtype`, computed in float64 then rounded once."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


class RopeQKV(torch.autograd.Function):
    """qkv (B, S, (H + 2G) D) -> the same layout with q and k rotated; backward rotates the
    gradient back (the transposed rotation) and passes v's gradient through."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads: int, num_kv_heads: int | None = None):
        ctx.save_for_backward(cos, sin)
        ctx.heads = (num_heads, num_kv_heads)
        return ops.rope_qkv(qkv, cos, sin, num_heads, num_kv_heads=num_kv_heads)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        heads, kv_heads = ctx.heads
        dqkv = ops.rope_qkv(grad.contiguous(), cos, sin, heads, inverse=True,
                            num_kv_heads=kv_heads)  # fmt: skip
        return dqkv, None, None, None, None


class RopeQKVParts(torch.autograd.Function):
    """qkv (B, S, (H + 2G) D) -> q (B, S, H, D), k, v (B, S, G, D): views of one tensor holding qkv
    with q and k rotated, as attention takes them. The backward takes the three gradients where
    attention left them and writes the fused gradient, q's and k's rotated back, in one kernel
    (graphfp8.ops.rope_fp8_backward's high-precision form): no cat of dq, dk, dv before the
    rotation (issue 33: one kernel and one (B, S, (H + 2G) D) round trip fewer per layer), the
    same bits as the cat and RopeQKV's backward."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, num_heads: int, num_kv_heads: int | None = None):
        g = num_kv_heads or num_heads
        ctx.save_for_backward(cos, sin)
        ctx.dtype, ctx.needs_heads = qkv.dtype, (num_heads, g, g)
        out = ops.rope_qkv(qkv, cos, sin, num_heads, num_kv_heads=num_kv_heads)
        b, s, width = qkv.shape
        parts = out.view(b, s, num_heads + 2 * g, width // (num_heads + 2 * g))
        return tuple(parts.split([num_heads, g, g], dim=2))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        grads = [g.contiguous() if g is not None else None for g in (dq, dk, dv)]
        if any(g is None for g in grads):  # a part that reached no loss: a zero gradient
            ref = next(g for g in grads if g is not None)
            shapes = [(*ref.shape[:2], n, ref.shape[3]) for n in ctx.needs_heads]
            grads = [g if g is not None else ref.new_zeros(shape)
                     for g, shape in zip(grads, shapes, strict=True)]  # fmt: skip
        dqkv = ops.rope_fp8_backward(grads, None, cos, sin, ctx.dtype)
        return dqkv, None, None, None, None
