"""Typed wrappers of RoPE's backward fused into the FP8 cast-transpose of the fused QKV gradient
(csrc/rope_cast.h; graphfp8/modules/_qkv_rope.py uses them under the kernel switch ROPE_CAST_BWD).

From dq (batch, seq, heads, head_dim), dk, dv (batch, seq, kv_heads, head_dim) in high precision:
g = rope_fp8_backward(grads) (dq, dk rotated back, rounded to their dtype), viewed as the
(batch * seq, (heads + 2 * kv_heads) * head_dim) gradient of the QKV projection, is cast as
cast_transpose(_dbias) casts it, bit for bit, without g being written.
"""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["rope_amax_", "rope_cast_fits", "rope_cast_transpose"]


def rope_cast_fits(grad_shape, kv_heads: int, dtype: torch.dtype, device) -> bool:
    """Whether the fused kernel takes gradients of dq's shape (batch, seq, heads, head_dim) with
    kv_heads key/value heads, of `dtype`, on `device`: always on the CPU; on CUDA where its
    16-byte vectors lie within one half of a head and its tiles are whole (rows and the fused
    width multiples of 16, head_dim % (32 / element size) == 0; csrc/cuda/rope_cast.cu)."""
    b, s, h, d = grad_shape
    if torch.device(device).type == "cpu":
        return True
    per_vector = 16 // torch.empty(0, dtype=dtype).element_size()
    return (b * s) % 16 == 0 and ((h + 2 * kv_heads) * d) % 16 == 0 and d % (2 * per_vector) == 0


@wraps_op("rope_cast_transpose")
def rope_cast_transpose(
    grads: list[torch.Tensor],
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    num_heads: int,
    quantizer,
    needs_dbias: bool,
    num_kv_heads: int | None = None,
):
    """The QKV projection's gradient cast for both FP8 GEMMs, from the gradients of q, k, v.

    Args:
        grads: [dq (batch, seq, heads, head_dim), dk, dv (batch, seq, kv_heads, head_dim)], one
            float32/bfloat16/float16 dtype, contiguous, not empty (on CUDA: rope_cast_fits).
        cos, sin: the forward's (>= seq, head_dim) float32 tables, or both None (no rotation).
        num_heads: query heads.
        quantizer: (scale, amax, fp8_dtype) or, under current scaling's fused path, (scale,
            amax, fp8_dtype, scaled_max) (graphfp8.fp8.current.CurrentQuantizer).
        needs_dbias: also return the column sums of the gradient (the projection's bias grad).
        num_kv_heads: key/value heads; None: num_heads.

    Returns:
        (out (M, W) FP8, out_t (W, M), scale_inv (1,) float32, dbias (W,) or None), M = batch *
        seq, W = (heads + 2 * kv_heads) * head_dim: what cast_transpose(_dbias) returns for the
        gradient.
    """
    g = grads[0]
    kv = num_kv_heads or num_heads
    rows, width = g.shape[0] * g.shape[1], (num_heads + 2 * kv) * g.shape[3]
    scale, amax, fp8_dtype = quantizer[:3]
    scaled_max = quantizer[3] if len(quantizer) > 3 else None
    out = torch.empty((rows, width), dtype=fp8_dtype, device=g.device)
    out_t = torch.empty((width, rows), dtype=fp8_dtype, device=g.device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=g.device)
    dbias = torch.empty(width, dtype=g.dtype, device=g.device) if needs_dbias else None
    ops.rope_cast_transpose(
        grads, cos, sin, num_heads, scale, out, out_t, scale_inv, amax, dbias, scaled_max, kv
    )
    return out, out_t, scale_inv, dbias


@wraps_op("rope_amax")
def rope_amax_(
    grads: list[torch.Tensor],
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    num_heads: int,
    amax: torch.Tensor,
    num_kv_heads: int | None = None,
) -> None:
    """amax = max(amax, max |g|) in place, g the gradient rope_cast_transpose casts (its current
    scaling amax pass; graphfp8.ops.amax_ of rope_fp8_backward's output, without that output).
    Arguments as for rope_cast_transpose; amax: (1,) float32."""
    ops.rope_amax(grads, cos, sin, num_heads, amax, num_kv_heads or num_heads)
