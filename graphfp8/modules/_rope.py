"""Rotary position embedding tables and the high-precision RoPE autograd Function (the bf16
attention path; FP8 attention fuses RoPE into its casts, graphfp8.ops.rope_fp8)."""

from __future__ import annotations

import torch

from graphfp8 import ops

__all__ = ["RopeQKV", "rope_tables"]


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
