"""Float64 twins of graphfp8.ops.sdpa_fp8's FP8 attention (graphfp8.reference has the kernels'):
they quantize P, O, dS and the gradients at cuDNN's points and return float64 references that tests
compare within tolerances (cuDNN's online softmax rounds differently). Test-only code."""

from __future__ import annotations

import math

import torch

from graphfp8.reference import abs_max, quantize

__all__ = ["sdpa_fp8_backward", "sdpa_fp8_forward"]


def _attn_operands(q, k, v, scales):
    """Dequantized (batch, heads, seq, d) float64 operands; kv heads repeated for GQA."""
    heads = q.shape[2]

    def bhsd(t, descale):
        x = t.double().transpose(1, 2) * descale.double().reshape(())
        return x.repeat_interleave(heads // t.shape[2], dim=1)

    return bhsd(q, scales["descale_q"]), bhsd(k, scales["descale_k"]), bhsd(v, scales["descale_v"])


def _attn_probabilities(qd, kd, attn_scale, causal, stats=None, segment_ids=None):
    s = torch.einsum("bhid,bhjd->bhij", qd, kd) * attn_scale
    if segment_ids is not None:  # within each token's segment only
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        s = s.masked_fill(~same, -math.inf)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    m = s.amax(dim=-1, keepdim=True) if stats is None else stats.double()
    return s, torch.exp(s - m), m


def sdpa_fp8_forward(q, k, v, scales: dict, attn_scale: float, causal: bool = True,
                     segment_ids=None) -> dict:  # fmt: skip
    """Twin of graphfp8.ops.sdpa_fp8_forward in float64, quantizing P and O at cuDNN's points
    (that module's docstring has the math). scales: graphfp8.ops.sdpa_fp8's FWD_SCALES names.

    Returns:
        {"o": FP8 (batch, seq, heads, d), "stats": (batch, heads, seq, 1) float32, "o_hp": the
        float64 O before its cast, "amax_s", "amax_o": (1,) float32}.
    """

    qd, kd, vd = _attn_operands(q, k, v, scales)
    _, p, m = _attn_probabilities(qd, kd, attn_scale, causal, segment_ids=segment_ids)
    row_sum = p.sum(dim=-1, keepdim=True)
    p_fp8 = quantize(p, scales["scale_s"], q.dtype).double()
    out = torch.einsum("bhij,bhjd->bhid", p_fp8, vd) * scales["descale_s"].double().reshape(())
    out = (out / row_sum).transpose(1, 2)
    return {
        "o": quantize(out, scales["scale_o"], q.dtype),
        "stats": (m + torch.log(row_sum)).float(),
        "o_hp": out,
        "amax_s": abs_max(p),
        "amax_o": abs_max(out),
    }


def sdpa_fp8_backward(q, k, v, o, d_o, stats, scales: dict, attn_scale: float,
                      causal: bool = True, segment_ids=None) -> dict:  # fmt: skip
    """Twin of graphfp8.ops.sdpa_fp8_backward in float64 (scales: BWD_SCALES names).

    Returns:
        {"dq", "dk", "dv": FP8 in d_o's dtype, "dq_hp", "dk_hp", "dv_hp": float64 before their
        casts, "amax_dp" (max |dS|), "amax_dq", "amax_dk", "amax_dv": (1,) float32, and
        "max_abs_dp": max |dO V^T| (what a kernel reporting the unscaled dP would give)}.
    """

    kv_heads = k.shape[2]
    qd, kd, vd = _attn_operands(q, k, v, scales)
    _, p, _ = _attn_probabilities(qd, kd, attn_scale, causal, stats, segment_ids)
    dod = d_o.double().transpose(1, 2) * scales["descale_do"].double().reshape(())
    od = o.double().transpose(1, 2) * scales["descale_o"].double().reshape(())
    p_fp8 = quantize(p, scales["scale_s"], q.dtype).double() * scales["descale_s"].double()
    d_v = torch.einsum("bhij,bhid->bhjd", p_fp8, dod)
    d_p = torch.einsum("bhid,bhjd->bhij", dod, vd)
    delta = (od * dod).sum(dim=-1, keepdim=True)
    d_s = p * (d_p - delta) * attn_scale
    ds_fp8 = quantize(d_s, scales["scale_dp"], d_o.dtype).double() * scales["descale_dp"].double()
    d_q = torch.einsum("bhij,bhjd->bhid", ds_fp8, kd)
    d_k = torch.einsum("bhij,bhid->bhjd", ds_fp8, qd)

    def per_kv_head(x):
        b, h, s, d = x.shape
        return x.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2) if h != kv_heads else x

    out = {"amax_dp": abs_max(d_s), "max_abs_dp": abs_max(d_p)}
    for name, x in (("dq", d_q), ("dk", per_kv_head(d_k)), ("dv", per_kv_head(d_v))):
        x = x.transpose(1, 2)
        out[f"{name}_hp"] = x
        out[f"amax_{name}"] = abs_max(x)
        out[name] = quantize(x, scales[f"scale_{name}"], d_o.dtype)
    return out
