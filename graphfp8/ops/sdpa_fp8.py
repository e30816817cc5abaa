"""FP8 scaled dot-product attention with cuDNN's quantization points: the shape rules, the two
dispatcher ops, and their CPU implementation (float32 emulation; cuDNN runs them on the GPU).

Forward, per (batch, head), with x = x_fp8 * descale_x (every descale a (1,) device scalar):

    S  = Q K^T * attn_scale                          causal: S[i, j > i] = -inf
    P  = exp(S - rowmax(S))        amax_S folds max P           (1 for every non-empty row)
    O  = (fp8(P * scale_S) * descale_S) V / rowsum(P)
    O_fp8 = fp8(O * scale_O)       amax_O folds max |O|;  stats = rowmax(S) + log(rowsum(P))

Backward, with P = exp(S - stats) (normalized), dO = dO_fp8 * descale_dO, O = O_fp8 * descale_O:

    dV = (fp8(P * scale_S) * descale_S)^T dO
    dP = dO V^T;  D = rowsum(O * dO);  dS = P * (dP - D) * attn_scale     amax_dP folds max |dS|
    dQ = (fp8(dS * scale_dP) * descale_dP) K;  dK = (fp8(dS * scale_dP) * descale_dP)^T Q
    dX_fp8 = fp8(dX * scale_dX), amax_dX folds max |dX| (X = Q, K, V)

P is quantized in Q's FP8 dtype (the forward format), dS in the gradients' dtype (the backward
format). The CPU implementation computes exactly this in float32 with torch ops (cuDNN computes
P against a running maximum, tile by tile, so the GPU differs by rounding); amaxes are folded
into the given slots with fmax, so they ignore NaN like the cast kernels.

Shapes: Q, O (batch, seq, heads, head_dim); K, V (batch, seq, kv_heads, head_dim), contiguous
(the BSHD layout); heads a multiple of kv_heads (grouped-query attention); stats (batch, heads,
seq, 1) float32. Self-attention only (one sequence length), causal only. With segment_ids
(batch, seq) the causal mask is also confined to each token's segment (packed documents, padding:
graphfp8.ops.segments): S[i, j] = -inf unless segment[j] == segment[i] (on the GPU, cuDNN's
ragged layout of graphfp8.ops.cudnn_ragged, whose stats are laid out (token, head)-major).
"""

from __future__ import annotations

import torch

from graphfp8.ops import cudnn_ragged, cudnn_sdpa
from graphfp8.ops._lib import wraps_op
from graphfp8.ops.cudnn_sdpa import BWD_SCALES, FWD_SCALES
from graphfp8.ops.segments import segment_mask

__all__ = [
    "BWD_SCALES",
    "FWD_SCALES",
    "check_sdpa_fp8",
    "sdpa_fp8_backward",
    "sdpa_fp8_forward",
]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# cuDNN's FP8 attention on Hopper (the frontend's support checks): head_dim a multiple of 16,
# at most 128. The same rule on every device, so that a CPU test fails wherever the GPU would.
MAX_HEAD_DIM = 128


def check_sdpa_fp8(q_shape, k_shape, v_shape, causal: bool, what: str = "graphfp8.sdpa_fp8"):
    """Raises ValueError for inputs FP8 attention does not support (before anything runs).

    Args:
        q_shape: (batch, seq, heads, head_dim).
        k_shape, v_shape: (batch, seq, kv_heads, head_dim).
        causal: the causal mask (the only mask FP8 attention supports).
        what: the name errors start with.
    """
    if not causal:
        raise ValueError(
            f"{what}: FP8 attention supports the causal mask only "
            "(attn_mask_type='causal'); run non-causal attention in bf16"
        )
    if len(q_shape) != 4 or len(k_shape) != 4 or tuple(k_shape) != tuple(v_shape):
        raise ValueError(
            f"{what}: expected q (batch, seq, heads, head_dim) and k, v (batch, seq, "
            f"kv_heads, head_dim), got {tuple(q_shape)}, {tuple(k_shape)}, "
            f"{tuple(v_shape)}"
        )
    b, s, h, d = q_shape
    if (k_shape[0], k_shape[1], k_shape[3]) != (b, s, d):
        raise ValueError(
            f"{what}: q {tuple(q_shape)} and k/v {tuple(k_shape)} must share batch, "
            "sequence length and head_dim (self-attention)"
        )
    if k_shape[2] < 1 or h % k_shape[2]:
        raise ValueError(f"{what}: heads ({h}) must be a multiple of kv_heads ({k_shape[2]})")
    if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"{what}: FP8 attention (cuDNN) needs head_dim a multiple of 16 and at "
            f"most {MAX_HEAD_DIM}, got {d}"
        )
    if b < 1 or s < 1:
        raise ValueError(f"{what}: empty input {tuple(q_shape)}")


def _check_operands(q, k, v, what: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != q.dtype or t.dtype not in _FP8:
            raise TypeError(f"{what}: '{name}' must be FP8 of one dtype with q, got {t.dtype}")
        if not t.is_contiguous() or t.device != q.device:
            raise ValueError(
                f"{what}: '{name}' must be contiguous (batch, seq, heads, head_dim) on {q.device}"
            )


def _check_segments(segment_ids, q, what: str) -> None:
    if segment_ids is None:
        return
    if (
        segment_ids.dtype.is_floating_point
        or segment_ids.is_complex()
        or tuple(segment_ids.shape) != tuple(q.shape[:2])
        or segment_ids.device != q.device
    ):
        raise ValueError(
            f"{what}: segment_ids must be an integer (batch, seq) = {tuple(q.shape[:2])} tensor "
            f"on {q.device}, got {segment_ids.dtype} {tuple(segment_ids.shape)} on "
            f"{segment_ids.device}"
        )
    if q.is_cuda:
        cudnn_ragged.check_enabled(what)


# The dispatcher ops (their CPU and CUDA kernels are registered at the end) and their wrappers -----

_LIB = torch.library.Library("graphfp8", "FRAGMENT")
_LIB.define(
    "sdpa_fp8_fwd(Tensor q, Tensor k, Tensor v, Tensor[] scales, Tensor(a!) o, Tensor(b!) stats, "
    "Tensor(c!)[] amax, float attn_scale, bool causal, Tensor? segment_ids=None) -> ()"
)
_LIB.define(
    "sdpa_fp8_bwd(Tensor q, Tensor k, Tensor v, Tensor o, Tensor d_o, Tensor stats, "
    "Tensor[] scales, Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor(d!)[] amax, "
    "float attn_scale, bool causal, Tensor? segment_ids=None) -> ()"
)


@wraps_op("sdpa_fp8_fwd")
def sdpa_fp8_forward(q, k, v, scales: dict, amax_s, amax_o, attn_scale: float, causal: bool = True,
                     segment_ids=None):  # fmt: skip
    """FP8 attention forward (this module's docstring has the math).

    Args:
        q: (batch, seq, heads, head_dim) FP8 (the forward format), contiguous.
        k, v: (batch, seq, kv_heads, head_dim), q's dtype, contiguous.
        scales: FWD_SCALES -> (1,) float32 device tensors.
        amax_s, amax_o: (1,) float32, folded in place (the S and O slots).
        attn_scale: the softmax scale, e.g. head_dim ** -0.5.
        causal: must be True.
        segment_ids: optional (batch, seq) integer segments on q's device.

    Returns:
        (o_fp8 (batch, seq, heads, head_dim) in q's dtype, stats (batch, heads, seq, 1) float32).
    """
    what = "graphfp8.sdpa_fp8_forward"
    check_sdpa_fp8(q.shape, k.shape, v.shape, causal, what)
    _check_operands(q, k, v, what)
    _check_segments(segment_ids, q, what)
    b, s, h, _ = q.shape
    o = torch.empty_like(q)
    stats = torch.empty(b, h, s, 1, dtype=torch.float32, device=q.device)
    torch.ops.graphfp8.sdpa_fp8_fwd(
        q,
        k,
        v,
        [scales[n] for n in FWD_SCALES],
        o,
        stats,
        [amax_s, amax_o],
        float(attn_scale),
        causal,
        segment_ids,
    )
    return o, stats


@wraps_op("sdpa_fp8_bwd")
def sdpa_fp8_backward(
    q, k, v, o, d_o, stats, scales: dict, amaxes, attn_scale: float, causal: bool = True,
    segment_ids=None,
):  # fmt: skip
    """FP8 attention backward (this module's docstring has the math).

    Args:
        q, k, v, o, stats: as the forward took and returned them.
        d_o: (batch, seq, heads, head_dim) FP8 (the backward format), contiguous.
        scales: BWD_SCALES -> (1,) float32 device tensors.
        amaxes: (amax_dp, amax_dq, amax_dk, amax_dv), (1,) float32 each, folded in place.
        attn_scale, causal, segment_ids: as for the forward.

    Returns:
        (dq, dk, dv): FP8 in d_o's dtype, shaped like q, k, v.
    """
    what = "graphfp8.sdpa_fp8_backward"
    check_sdpa_fp8(q.shape, k.shape, v.shape, causal, what)
    _check_operands(q, k, v, what)
    if o.shape != q.shape or d_o.shape != q.shape or d_o.dtype not in _FP8 or o.dtype != q.dtype:
        raise ValueError(f"{what}: o and d_o must be FP8 shaped like q {tuple(q.shape)}")
    _check_segments(segment_ids, q, what)
    dq, dk, dv = (torch.empty(t.shape, dtype=d_o.dtype, device=q.device) for t in (q, k, v))
    torch.ops.graphfp8.sdpa_fp8_bwd(
        q,
        k,
        v,
        o,
        d_o,
        stats,
        [scales[n] for n in BWD_SCALES],
        dq,
        dk,
        dv,
        list(amaxes),
        float(attn_scale),
        causal,
        segment_ids,
    )
    return dq, dk, dv


def _quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = _FP8_MAX[dtype]
    return x.clamp(-limit, limit).to(dtype)


def _fold_amax_(amax: torch.Tensor, x: torch.Tensor) -> None:
    amax.copy_(torch.fmax(amax, x.abs().amax().reshape(1)))


def _bhsd(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, seq, h, d) FP8 -> (batch, heads, seq, d) float32, kv heads repeated for GQA."""
    x = t.float().transpose(1, 2)
    return x.repeat_interleave(heads // t.shape[2], dim=1) if t.shape[2] != heads else x


def _scores(q, k, descale_q, descale_k, attn_scale: float, causal: bool, segment_ids=None):
    heads = q.shape[2]
    s = torch.matmul(_bhsd(q, heads), _bhsd(k, heads).transpose(-1, -2))
    s = s * (descale_q * descale_k * attn_scale)
    if segment_ids is not None:
        return s.masked_fill(~segment_mask(segment_ids, causal), float("-inf"))
    if causal:
        n = s.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _fwd_cpu(q, k, v, scales, o, stats, amax, attn_scale, causal, segment_ids=None) -> None:
    descale_q, descale_k, descale_v, descale_s, scale_s, scale_o = scales
    s = _scores(q, k, descale_q, descale_k, attn_scale, causal, segment_ids)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    row_sum = p.sum(dim=-1, keepdim=True)
    _fold_amax_(amax[0], p)
    p_fp8 = _quantize(p * scale_s, q.dtype).float()
    out = torch.matmul(p_fp8, _bhsd(v, q.shape[2])) * (descale_v * descale_s) / row_sum
    _fold_amax_(amax[1], out)
    o.copy_(_quantize(out * scale_o, o.dtype).transpose(1, 2))
    stats.copy_(m + torch.log(row_sum))


def _group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, seq, d) -> (batch, kv_heads, seq, d): a kv head's gradient sums its group."""
    b, h, s, d = x.shape
    return x if h == kv_heads else x.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _bwd_cpu(q, k, v, o, d_o, stats, scales, dq, dk, dv, amax, attn_scale, causal,
             segment_ids=None) -> None:  # fmt: skip
    (
        descale_q,
        descale_k,
        descale_v,
        descale_o,
        descale_do,
        descale_s,
        descale_dp,
        scale_s,
        scale_dp,
        scale_dq,
        scale_dk,
        scale_dv,
    ) = scales
    heads, kv_heads = q.shape[2], k.shape[2]
    p = torch.exp(_scores(q, k, descale_q, descale_k, attn_scale, causal, segment_ids) - stats)
    p_fp8 = _quantize(p * scale_s, q.dtype).float()
    grad = _bhsd(d_o, heads)
    d_v = torch.matmul(p_fp8.transpose(-1, -2), grad) * (descale_s * descale_do)
    d_p = torch.matmul(grad, _bhsd(v, heads).transpose(-1, -2)) * (descale_do * descale_v)
    delta = (o.float() * d_o.float()).sum(dim=-1, keepdim=True).transpose(1, 2)
    d_s = p * (d_p - delta * (descale_o * descale_do)) * attn_scale
    _fold_amax_(amax[0], d_s)
    ds_fp8 = _quantize(d_s * scale_dp, dq.dtype).float()
    d_q = torch.matmul(ds_fp8, _bhsd(k, heads)) * (descale_k * descale_dp)
    d_k = torch.matmul(ds_fp8.transpose(-1, -2), _bhsd(q, heads)) * (descale_q * descale_dp)
    for out, grad_x, scale, slot in (
        (dq, d_q, scale_dq, amax[1]),
        (dk, _group_sum(d_k, kv_heads), scale_dk, amax[2]),
        (dv, _group_sum(d_v, kv_heads), scale_dv, amax[3]),
    ):
        _fold_amax_(slot, grad_x)
        out.copy_(_quantize(grad_x * scale, out.dtype).transpose(1, 2))


_LIB.impl("sdpa_fp8_fwd", _fwd_cpu, "CPU")
_LIB.impl("sdpa_fp8_bwd", _bwd_cpu, "CPU")
_LIB.impl("sdpa_fp8_fwd", cudnn_sdpa.forward, "CUDA")
_LIB.impl("sdpa_fp8_bwd", cudnn_sdpa.backward, "CUDA")
