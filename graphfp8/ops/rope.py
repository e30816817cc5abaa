"""Typed wrapper of the fused-QKV rotary embedding kernel."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["rope_qkv"]


@wraps_op("rope_qkv")
def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    inverse: bool = False,
    *,
    out: torch.Tensor | None = None,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """Rotates the q and k heads of a fused QKV tensor by their positions; v is copied.

    For each head vector x and i < half = head_dim / 2 (GPT-NeoX / Llama half-split layout):
    out[i] = x[i] cos[s, i] - x[i + half] sin[s, i], out[i + half] = x[i + half] cos[s, i + half]
    + x[i] sin[s, i + half]. `inverse` applies the transposed rotation (the backward).

    Args:
        qkv: (batch, seq, (num_heads + 2 * num_kv_heads) * head_dim) float32/bfloat16/float16,
            contiguous: per token num_heads q heads, then num_kv_heads k and v heads (with
            num_kv_heads == num_heads the (batch, seq, 3, num_heads, head_dim) layout).
        cos, sin: (>= seq, head_dim) float32 tables; row s is position s.
        num_heads: query heads; head_dim must be even.
        inverse: rotate by -angle, transposed (the gradient of the forward rotation).
        out: optional destination shaped like qkv (may be qkv itself).
        num_kv_heads: key/value heads (grouped-query attention); None: num_heads.

    Returns:
        out: shaped like qkv, qkv's dtype.

    Raises:
        TypeError: a dtype is wrong (the op's own checks, in csrc/ops/).
        ValueError: a shape, layout or device is wrong.
    """
    if out is None:
        out = torch.empty_like(qkv)
    ops.rope_qkv(qkv, cos, sin, num_heads, inverse, out, num_kv_heads or 0)
    return out
