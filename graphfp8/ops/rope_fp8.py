"""Typed wrappers of the RoPE kernels fused with the FP8 casts of q, k, v (and their backward).

Forward: a fused QKV projection output (batch, seq, (heads + 2 * kv_heads) * head_dim) -> q
(batch, seq, heads, head_dim), k and v (batch, seq, kv_heads, head_dim) in FP8, contiguous (the
BSHD layout attention kernels take), with q and k rotated first (kv_heads < heads: grouped-query
attention). The result equals rope_qkv followed by one cast per part, bit for bit.
Backward: the three FP8 gradients -> the fused QKV gradient, dq and dk rotated back, in one pass.
"""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["rope_fp8", "rope_fp8_backward"]

_HP = (torch.float32, torch.bfloat16, torch.float16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_tables(name: str, cos, sin, seq: int, head_dim: int, device) -> None:
    if (cos is None) != (sin is None):
        raise ValueError(f"{name}: arguments 'cos' and 'sin' must be given together")
    for arg, t in (("cos", cos), ("sin", sin)):
        if t is None:
            continue
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: argument '{arg}' must be float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[0] < seq or t.shape[1] != head_dim:
            raise ValueError(
                f"{name}: argument '{arg}' must be (>= {seq}, {head_dim}), got {tuple(t.shape)}"
            )
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"{name}: argument '{arg}' must be contiguous on {device}")


def _head_dim(name: str, width: int, num_heads: int, kv_heads: int) -> int:
    if num_heads < 1 or kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"{name}: num_heads ({num_heads}) must be a positive multiple of "
                         f"num_kv_heads ({kv_heads})")  # fmt: skip
    if width % (num_heads + 2 * kv_heads):
        raise ValueError(
            f"{name}: last dim {width} is not (num_heads + 2 * num_kv_heads) * head_dim with "
            f"num_heads {num_heads}, num_kv_heads {kv_heads}"
        )
    head_dim = width // (num_heads + 2 * kv_heads)
    if head_dim % 2:
        raise ValueError(f"{name}: head_dim must be even, got {head_dim}")
    return head_dim


@wraps_op("rope_fp8")
def rope_fp8(
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    num_heads: int,
    quantizers,
    num_kv_heads: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rotates q and k of a fused QKV tensor and casts q, k, v to FP8 in one pass.

    Each part p (q, k, v) is cast with its own quantizer: out = saturate(r * scale), amax folds
    max |r| in place, scale_inv receives 1 / scale, where r is the rotated value rounded to qkv's
    dtype (q, k) or the value itself (v, or every part without tables).

    Args:
        qkv: (batch, seq, (heads + 2 * kv_heads) * head_dim) float32/bfloat16/float16,
            contiguous: per token the q heads, then the k and the v heads (rope_qkv's layout).
        cos, sin: (>= seq, head_dim) float32 rotary tables (rope_qkv's layout), or both None
            for a plain cast of the three parts.
        num_heads: query heads; head_dim must be even.
        quantizers: three (scale (1,) float32, amax (1,) float32, fp8_dtype) triples (q, k, v;
            graphfp8.fp8.slots.Quantizer), one FP8 dtype for all three.
        num_kv_heads: key/value heads; None: num_heads.

    Returns:
        ([q, k, v], [q_scale_inv, k_scale_inv, v_scale_inv]): FP8 q (batch, seq, heads,
        head_dim), k and v (batch, seq, kv_heads, head_dim), and (1,) float32 tensors.
    """
    name = "graphfp8.rope_fp8"
    if qkv.dtype not in _HP:
        raise TypeError(
            f"{name}: argument 'qkv' must be float32, bfloat16 or float16, got {qkv.dtype}"
        )
    if qkv.dim() != 3 or not qkv.is_contiguous():
        raise ValueError(
            f"{name}: argument 'qkv' must be a contiguous (batch, seq, 3 * hidden) "
            f"tensor, got {tuple(qkv.shape)}"
        )
    kv_heads = num_kv_heads or num_heads
    head_dim = _head_dim(name, qkv.shape[-1], num_heads, kv_heads)
    _check_tables(name, cos, sin, qkv.shape[1], head_dim, qkv.device)
    dtypes = {dtype for _, _, dtype in quantizers}
    if len(quantizers) != 3 or len(dtypes) != 1 or not dtypes <= set(_FP8):
        raise ValueError(
            f"{name}: need 3 quantizers of one FP8 dtype, got {sorted(map(str, dtypes))}"
        )
    b, s, fp8_dtype = qkv.shape[0], qkv.shape[1], dtypes.pop()
    out = [torch.empty((b, s, h, head_dim), dtype=fp8_dtype, device=qkv.device)
           for h in (num_heads, kv_heads, kv_heads)]  # fmt: skip
    scale_inv = [torch.empty(1, dtype=torch.float32, device=qkv.device) for _ in range(3)]
    ops.rope_fp8(
        qkv,
        cos,
        sin,
        num_heads,
        [s for s, _, _ in quantizers],
        out,
        scale_inv,
        [a for _, a, _ in quantizers],
        kv_heads,
    )
    return out, scale_inv


@wraps_op("rope_fp8_backward")
def rope_fp8_backward(
    grads: list[torch.Tensor],
    scale_inv: list[torch.Tensor] | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The fused QKV gradient from the gradients of q, k and v: dequantized in fp32 (FP8) or
    read as they are (high precision), dq and dk rotated back (rope_qkv's inverse rotation),
    rounded once to `dtype`. With high-precision gradients this is rope_qkv(cat(grads), inverse)
    in one pass, bit for bit (the bf16 attention path's backward: modules/_rope.RopeQKVParts).

    Args:
        grads: [dq (batch, seq, heads, head_dim), dk, dv (batch, seq, kv_heads, head_dim)], FP8
            of one dtype, or all of `dtype`; contiguous.
        scale_inv: the FP8 gradients' (1,) float32 scale_inv; None for high-precision ones.
        cos, sin: the forward's rotary tables, or both None.
        dtype: float32, bfloat16 or float16.

    Returns:
        (batch, seq, (heads + 2 * kv_heads) * head_dim) tensor of `dtype`.
    """
    name = "graphfp8.rope_fp8_backward"
    if len(grads) != 3 or (scale_inv is not None and len(scale_inv) != 3):
        raise ValueError(f"{name}: need 3 gradients and 3 scale_inv tensors (None: high precision)")
    g, kv = grads[0], grads[1]
    same = lambda t, ref: t.dim() == 4 and t.shape == ref.shape and t.dtype == g.dtype  # noqa: E731
    if not (g.dim() == 4 and same(kv, kv) and same(grads[2], kv)
            and (kv.shape[:2], kv.shape[3]) == (g.shape[:2], g.shape[3])):  # fmt: skip
        raise ValueError(
            f"{name}: the gradients must be dq (batch, seq, heads, head_dim) and dk, dv "
            f"(batch, seq, kv_heads, head_dim) of one dtype, got "
            f"{[tuple(t.shape) for t in grads]}"
        )
    if dtype not in _HP:
        raise TypeError(f"{name}: dtype must be float32, bfloat16 or float16, got {dtype}")
    if (g.dtype in _FP8) != (scale_inv is not None) or (g.dtype not in _FP8 and g.dtype != dtype):
        raise TypeError(
            f"{name}: the gradients must be FP8 with scale_inv, or of dtype {dtype} without; got "
            f"{g.dtype} with scale_inv {'given' if scale_inv is not None else 'None'}"
        )
    batch, seq, heads, head_dim = g.shape
    kv_heads = kv.shape[2]
    _head_dim(name, (heads + 2 * kv_heads) * head_dim, heads, kv_heads)
    if head_dim % 2:
        raise ValueError(f"{name}: head_dim must be even, got {head_dim}")
    _check_tables(name, cos, sin, seq, head_dim, g.device)
    out = torch.empty(batch, seq, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=g.device)
    ops.rope_fp8_backward(grads, scale_inv or [], cos, sin, heads, out, kv_heads)
    return out
