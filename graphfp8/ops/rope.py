"""Typed wrapper of the fused-QKV rotary embedding kernel."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops

__all__ = ["rope_qkv"]

_HP = (torch.float32, torch.bfloat16, torch.float16)


def _check(qkv, cos, sin, num_heads: int) -> None:
    """The op's checks, made before the dispatcher call (the C++ op repeats them)."""
    name = "graphfp8.rope_qkv"
    if qkv.dtype not in _HP:
        raise TypeError(f"{name}: argument 'qkv' must be float32, bfloat16 or float16, "
                        f"got {qkv.dtype}")  # fmt: skip
    if qkv.dim() != 3:
        raise ValueError(f"{name}: argument 'qkv' must be (batch, seq, 3 * hidden), got "
                         f"{tuple(qkv.shape)}")  # fmt: skip
    if not qkv.is_contiguous():
        raise ValueError(f"{name}: argument 'qkv' must be contiguous")
    width = qkv.shape[-1]
    if num_heads < 1 or width % (3 * num_heads):
        raise ValueError(f"{name}: last dim {width} is not 3 * num_heads ({num_heads}) * "
                         "head_dim")  # fmt: skip
    head_dim = width // (3 * num_heads)
    if head_dim % 2:
        raise ValueError(f"{name}: head_dim must be even, got {head_dim}")
    for arg, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: argument '{arg}' must be float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] < qkv.shape[1] or t.shape[1] != head_dim:
            raise ValueError(f"{name}: argument '{arg}' must be (>= {qkv.shape[1]}, {head_dim}),"
                             f" got {tuple(t.shape)}")  # fmt: skip
        if t.device != qkv.device or not t.is_contiguous():
            raise ValueError(f"{name}: argument '{arg}' must be contiguous on {qkv.device}")


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
    """
    _check(qkv, cos, sin, num_heads)
    if out is None:
        out = torch.empty_like(qkv)
    ops.rope_qkv(qkv, cos, sin, num_heads, inverse, out)
    return out
