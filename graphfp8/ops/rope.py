"""Typed wrapper of the fused-QKV rotary embedding kernel."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops

__all__ = ["rope_qkv"]


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    inverse: bool = False,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotates the q and k heads of a fused QKV tensor by their positions; v is copied.

    For each head vector x and i < half = head_dim / 2 (GPT-NeoX / Llama half-split layout):
    out[i] = x[i] cos[s, i] - x[i + half] sin[s, i], out[i + half] = x[i + half] cos[s, i + half]
    + x[i] sin[s, i + half]. `inverse` applies the transposed rotation (the backward).

    Args:
        qkv: (batch, seq, 3 * hidden) float32/bfloat16/float16, contiguous, laid out as
            (batch, seq, 3, num_heads, head_dim) with q, k, v in that order.
        cos, sin: (>= seq, head_dim) float32 tables; row s is position s.
        num_heads: heads per q/k/v; head_dim = hidden / num_heads must be even.
        inverse: rotate by -angle, transposed (the gradient of the forward rotation).
        out: optional destination shaped like qkv (may be qkv itself).

    Returns:
        out: (batch, seq, 3 * hidden), qkv's dtype.

    Raises:
        TypeError: a dtype is wrong (the op's own checks, in csrc/ops/).
        ValueError: a shape, layout or device is wrong.
    """
    if out is None:
        out = torch.empty_like(qkv)
    ops.rope_qkv(qkv, cos, sin, num_heads, inverse, out)
    return out
