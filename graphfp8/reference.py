"""Pure-PyTorch twins of every graphfp8 op, with the dispatcher ops' signatures.

Each twin writes into the tensors it is given exactly as the kernel does, so tests compare bit
for bit. Runtime code never imports this module; tests and CPU debugging do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphfp8.fp8.recipe import fp8_max

__all__ = [
    "quantize",
    "abs_max",
    "cast_to_fp8",
    "cast_transpose",
    "fp8_transpose",
    "scale_update",
    "dequantize",
    "cast_transpose_dbias",
    "gelu_cast_transpose",
    "dgelu_cast_transpose_dbias",
    "rope_qkv",
    "rope_fp8",
    "rope_fp8_backward",
]

FLT_MAX = torch.finfo(torch.float32).max


def _skip(noop: torch.Tensor | None) -> bool:
    return noop is not None and bool(noop.reshape(()).item() == 1.0)


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """saturate(x * scale) in fp8_dtype, every NaN as the canonical 0x7F.

    x: (...) any float dtype; scale: (1,) or () float32.
    """
    limit = fp8_max(fp8_dtype)
    scaled = x.float() * scale.reshape(())
    q = scaled.clamp(-limit, limit).to(fp8_dtype)
    nan_bits = torch.full_like(q.view(torch.uint8), 0x7F)
    return torch.where(torch.isnan(scaled), nan_bits, q.view(torch.uint8)).view(fp8_dtype)


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a (1,) float32 tensor, ignoring NaNs (like fmaxf); 0 for an empty x."""
    a = x.float().abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    return (a.amax() if a.numel() else a.new_zeros(())).reshape(1)


def _cast_common(x, scale, out, scale_inv, amax):
    out.copy_(quantize(x, scale, out.dtype))
    amax.copy_(torch.maximum(amax, abs_max(x).reshape(amax.shape)))
    scale_inv.copy_(torch.reciprocal(scale).reshape(scale_inv.shape))


def cast_to_fp8(x, scale, out, scale_inv, amax, noop=None) -> None:
    """Twin of torch.ops.graphfp8.cast_to_fp8."""
    if _skip(noop):
        return
    _cast_common(x, scale, out, scale_inv, amax)


def cast_transpose(x, scale, out, out_t, scale_inv, amax, noop=None) -> None:
    """Twin of torch.ops.graphfp8.cast_transpose."""
    if _skip(noop):
        return
    _cast_common(x, scale, out, scale_inv, amax)
    out_t.copy_(out.t())


def fp8_transpose(x, out_t, noop=None) -> None:
    """Twin of torch.ops.graphfp8.fp8_transpose."""
    if _skip(noop):
        return
    out_t.copy_(x.t())


def scale_update(amax_history, scale, scaled_max, most_recent) -> None:
    """Twin of torch.ops.graphfp8.scale_update: docs/fp8.md's delayed-scaling math, all slots."""
    length, slots = amax_history.shape
    a = amax_history[0].clone()
    roll = a != 0
    window = torch.cat([amax_history[1:], a[None]], dim=0)  # H[1..L-1] and a
    window = torch.where(torch.isnan(window), torch.zeros_like(window), window)
    m = torch.where(roll, window.amax(dim=0), torch.zeros_like(a))
    zeros = amax_history.new_zeros(1, slots)
    rolled = torch.cat([zeros, amax_history[2:], a[None]], dim=0) if length > 1 else zeros
    amax_history.copy_(torch.where(roll[None], rolled, amax_history))
    amax = a if most_recent else m
    ok = torch.isfinite(amax) & (amax > 0)
    new_scale = torch.where(ok, scaled_max / amax, scale)
    scale.copy_(torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale))


def dequantize(x, scale_inv, out) -> None:
    """Twin of torch.ops.graphfp8.dequantize."""
    out.copy_((x.float() * scale_inv.reshape(())).to(out.dtype))


def cast_transpose_dbias(x, scale, out, out_t, scale_inv, amax, dbias) -> None:
    """Twin of torch.ops.graphfp8.cast_transpose_dbias: cast_transpose, then the fp32 row sum."""
    cast_transpose(x, scale, out, out_t, scale_inv, amax)
    dbias.copy_(x.float().sum(dim=0).to(dbias.dtype))


def gelu_cast_transpose(x, scale, out, out_t, scale_inv, amax) -> None:
    """Twin of torch.ops.graphfp8.gelu_cast_transpose: torch's tanh GELU, then cast_transpose."""
    cast_transpose(F.gelu(x, approximate="tanh"), scale, out, out_t, scale_inv, amax)


def dgelu_cast_transpose_dbias(dy, x, scale, out, out_t, scale_inv, amax, dbias) -> None:
    """Twin of torch.ops.graphfp8.dgelu_cast_transpose_dbias: torch's tanh gelu_backward, then
    cast_transpose_dbias of the result."""
    dx = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
    cast_transpose_dbias(dx, scale, out, out_t, scale_inv, amax, dbias)


def rope_qkv(qkv, cos, sin, num_heads, inverse, out) -> None:
    """Twin of torch.ops.graphfp8.rope_qkv: the rotation in float32, each product and sum
    rounded on its own, then rounded to qkv's dtype."""
    b, s, width = qkv.shape
    head_dim = width // (3 * num_heads)
    half = head_dim // 2
    x = qkv.view(b, s, 3, num_heads, head_dim).float()
    c = cos[:s, None, None, :].float()  # (s, 1, 1, head_dim): broadcast over parts, heads
    n = sin[:s, None, None, :].float()
    lo, hi = x[:, :, :2, :, :half], x[:, :, :2, :, half:]
    c_lo, c_hi, n_lo, n_hi = c[..., :half], c[..., half:], n[..., :half], n[..., half:]
    if inverse:
        rot = torch.cat([lo * c_lo + hi * n_hi, hi * c_hi - lo * n_lo], dim=-1)
    else:
        rot = torch.cat([lo * c_lo - hi * n_lo, hi * c_hi + lo * n_hi], dim=-1)
    y = torch.cat([rot, x[:, :, 2:]], dim=2)
    out.copy_(y.to(out.dtype).view(b, s, width))


def rope_fp8(qkv, cos, sin, num_heads, scale, out, scale_inv, amax) -> None:
    """Twin of torch.ops.graphfp8.rope_fp8: rope_qkv (the identity without tables), then one
    cast_to_fp8 per part into (batch, seq, heads, head_dim)."""
    b, s, width = qkv.shape
    rotated = qkv.clone()
    if cos is not None:
        rope_qkv(qkv, cos, sin, num_heads, False, rotated)
    parts = rotated.view(b, s, 3, num_heads, width // (3 * num_heads))
    for p in range(3):
        cast_to_fp8(parts[:, :, p].contiguous(), scale[p], out[p], scale_inv[p], amax[p])


def rope_fp8_backward(grads, scale_inv, cos, sin, num_heads, out) -> None:
    """Twin of torch.ops.graphfp8.rope_fp8_backward: each part dequantized in float32, rope_qkv's
    inverse rotation in float32 on the packed gradient, one rounding to out's dtype."""
    b, s, width = out.shape
    parts = [g.float() * si.reshape(()) for g, si in zip(grads, scale_inv, strict=True)]
    packed = torch.stack(parts, dim=2).reshape(b, s, width)
    rotated = packed.clone()
    if cos is not None:
        rope_qkv(packed, cos, sin, num_heads, True, rotated)
    out.copy_(rotated.to(out.dtype))
