"""TransformerLayer's attention with explicit positions, an explicit mask or a KV cache: the path
of generation (a prefill, then one token at a time against the cached keys and values) and of
Hugging Face's position_ids (packed documents). Torch ops in the activations' dtype, differentiable:

    qkv (B, S, (H + 2G) D) -> q, k, v -> RoPE at position_ids (float32 math, as the RoPE kernel)
      -> k, v appended to the cache -> SDPA over every cached key (B, S, H D)

The GEMMs around it (QKV, projection, MLP) run as in training, in FP8 under fp8_autocast. FP8
attention (a recipe with fp8_dpa) has no such path: the layer refuses it in training and runs this
one in eval mode (generate() after FP8 training), leaving the attention's FP8 slots untouched.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["KVCache", "explicit_attention", "rotate"]


class KVCache(Protocol):
    """One layer's key/value store: takes this call's keys and values, returns every cached one.

    k, v: (B, G, S, D) in the activations' dtype; returns (B, G, T, D), T >= S the keys so far
    (this call's last). `length()` is T before the call (the position of this call's first token).
    """

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def length(self) -> int: ...


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x (B, S, N, D) with per-token tables cos, sin (B, S, D) float32: the RoPE kernel's
    math (graphfp8.reference.rope_qkv), float32 with one rounding per operation, then x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    lo, hi = xf[..., :half], xf[..., half:]
    c, n = cos[:, :, None, :], sin[:, :, None, :]
    c_lo, c_hi, n_lo, n_hi = c[..., :half], c[..., half:], n[..., :half], n[..., half:]
    rot = torch.cat([lo * c_lo - hi * n_lo, hi * c_hi + lo * n_hi], dim=-1)
    return rot.to(x.dtype)


def _mask(attn_mask, batch: int, seq: int, total: int, device) -> torch.Tensor:
    """Causal over the cache (query i sits at key total - seq + i) and `attn_mask`; each query may
    always attend to itself, so a padding query's softmax row stays finite (its output is unused,
    but NaN there would reach the cached values and, multiplied by a zero weight, every row)."""
    q_pos = torch.arange(total - seq, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    allowed = (k_pos <= q_pos).expand(batch, 1, seq, total)
    if attn_mask is not None:
        allowed = allowed & attn_mask
    return allowed | (k_pos == q_pos)


def explicit_attention(layer, qkv: torch.Tensor, position_ids, attn_mask, kv_cache) -> torch.Tensor:
    """Causal self-attention of a TransformerLayer from its fused QKV output.

    Args:
        layer: the TransformerLayer (heads, groups, head_dim, rotary tables, softmax scale).
        qkv: (B, S, (H + 2G) D), high precision.
        position_ids: (B, S) int64 positions for RoPE, or None: T0 + arange(S), T0 the cached
            length.
        attn_mask: (B, 1, S, T) bool, True where a query may attend (ANDed with causality), or
            None.
        kv_cache: a KVCache, or None (the keys are this call's).

    Returns:
        (B, S, H D) in qkv's dtype.
    """
    b, s, _ = qkv.shape
    h, g, d = layer.num_heads, layer.num_gqa_groups, layer.head_dim
    past = kv_cache.length() if kv_cache is not None else 0
    q, k, v = qkv.view(b, s, h + 2 * g, d).split([h, g, g], dim=2)
    if layer.rope:
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=qkv.device).expand(b, s)
        cos, sin = layer.rope_cos.float()[position_ids], layer.rope_sin.float()[position_ids]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kv_cache is not None:
        k, v = kv_cache(k, v)
    mask = _mask(attn_mask, b, s, k.shape[2], qkv.device)
    core = layer.core_attention
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=core.softmax_scale,
                                         dropout_p=core.attention_dropout if core.training else 0.0,
                                         enable_gqa=g != h)  # fmt: skip
    return out.transpose(1, 2).reshape(b, s, h * d)
