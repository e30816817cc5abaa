"""Pure-PyTorch twins of every graphfp8 op, with the dispatcher ops' signatures.

Longer than ~400 lines: it is the one module of every kernel's twin (tests import one name).

Each twin writes into the tensors it is given exactly as the kernel does, so tests compare bit
for bit. The FP8 attention twins, float64 references compared within tolerances, are in
graphfp8/reference_attention.py. Runtime code never imports this module; tests and CPU debugging
do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphfp8.fp8.recipe import fp8_max
from graphfp8.ops.blockwise import torch_quantize
from graphfp8.ops.blockwise_stats import _blocks
from graphfp8.ops.glu import dglu, glu
from graphfp8.reference_blockwise import blockwise_act, mlp_act, mlp_dact

__all__ = [
    "quantize",
    "abs_max",
    "amax",
    "gelu_amax",
    "dgelu_amax",
    "layernorm_amax",
    "rmsnorm_amax",
    "cast_to_fp8",
    "cast_transpose",
    "fp8_transpose",
    "grad_fold_",
    "scale_update",
    "current_scale",
    "dequantize",
    "cast_transpose_dbias",
    "gelu_cast_transpose",
    "dgelu_cast_transpose_dbias",
    "glu_cast_transpose",
    "dglu_cast_transpose_dbias",
    "rope_qkv",
    "layernorm_fp8",
    "rmsnorm_fp8",
    "layernorm_bwd",
    "rmsnorm_bwd",
    "rope_fp8",
    "rope_fp8_backward",
    "cast_stats",
    "cast_stats_hp",
    "blockwise_quantize",
    "blockwise_act",
    "blockwise_norm",
    "blockwise_stats",
    "mlp_act",
    "mlp_dact",
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
    if amax is not None:
        amax.copy_(torch.maximum(amax, abs_max(x).reshape(amax.shape)))
    scale_inv.copy_(torch.reciprocal(scale).reshape(scale_inv.shape))


def _current(scale, amax, scaled_max):
    """A cast's `scaled_max` form (current scaling computed by the cast): the one-slot update of
    scale from amax (a history of length 1), before anything else. Returns where the cast folds
    its own amax: `amax` without scaled_max, nowhere (None) with it."""
    if scaled_max is None:
        return amax
    scale_update(amax.view(1, 1), scale.view(1), scaled_max.reshape(1), True)
    return None


def amax(x, amax, noop=None) -> None:
    """Twin of torch.ops.graphfp8.amax: max |x| folded into amax, nothing else written."""
    if not _skip(noop):
        amax.copy_(torch.maximum(amax, abs_max(x).reshape(amax.shape)))


def gelu_amax(x, amax) -> None:
    """Twin of torch.ops.graphfp8.gelu_amax: gelu_cast_transpose's amax alone."""
    amax.copy_(torch.maximum(amax, abs_max(F.gelu(x, approximate="tanh")).reshape(amax.shape)))


def dgelu_amax(dy, x, amax) -> None:
    """Twin of torch.ops.graphfp8.dgelu_amax: dgelu_cast_transpose_dbias's amax alone."""
    dx = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
    amax.copy_(torch.maximum(amax, abs_max(dx).reshape(amax.shape)))


def cast_to_fp8(x, scale, out, scale_inv, amax, noop=None, scaled_max=None) -> None:
    """Twin of torch.ops.graphfp8.cast_to_fp8."""
    amax = _current(scale, amax, scaled_max)
    if _skip(noop):
        return
    _cast_common(x, scale, out, scale_inv, amax)


def cast_transpose(x, scale, out, out_t, scale_inv, amax, noop=None, scaled_max=None) -> None:
    """Twin of torch.ops.graphfp8.cast_transpose."""
    amax = _current(scale, amax, scaled_max)
    if _skip(noop):
        return
    _cast_common(x, scale, out, scale_inv, amax)
    out_t.copy_(out.t())


def fp8_transpose(x, out_t, noop=None) -> None:
    """Twin of torch.ops.graphfp8.fp8_transpose."""
    if _skip(noop):
        return
    out_t.copy_(x.t())


def grad_fold_(buffer, grad, first) -> None:
    """Twin of torch.ops.graphfp8.grad_fold_: eager AccumulateGrad's two cases, the first
    microbatch's gradient taken as it is (first != 0), later ones added."""
    if int(first.item()) != 0:
        buffer.copy_(grad)
    else:
        buffer.add_(grad)


def fp8_gemm_accumulate(a, a_scale_inv, b_t, b_scale_inv, out) -> None:
    """out (m, n) float32 += (a (m, k) * a_scale_inv) @ (b_t (n, k) * b_scale_inv).T in fp32:
    torch's CPU emulation of _scaled_mm (operands decoded and scaled first), then the add."""
    out.add_((a.float() * a_scale_inv) @ (b_t.float() * b_scale_inv).t())


def fp8_gemm_into(a, a_scale_inv, b_t, b_scale_inv, out, alpha_beta) -> None:
    """out (m, n) = alpha * (a (m, k) * a_scale_inv) @ (b_t (n, k) * b_scale_inv).T + beta * out,
    in fp32, rounded once to out's dtype; beta = 0 reads nothing of out (cuBLAS's rule)."""
    alpha, beta = (float(v) for v in alpha_beta.cpu())
    total = alpha * ((a.float() * a_scale_inv) @ (b_t.float() * b_scale_inv).t())
    if beta != 0.0:
        total = total + beta * out.float()
    out.copy_(total)


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


def current_scale(x: torch.Tensor, scale: torch.Tensor, scaled_max: torch.Tensor) -> torch.Tensor:
    """Twin of Float8CurrentScaling's per-cast scale (graphfp8/fp8/current.py): the update of a
    one-long history whose H[0] is max|x|. x: (...); scale: (1,) float32, the slot's previous
    scale; scaled_max: (1,) float32. Returns the new (1,) float32 scale."""
    history = abs_max(x).reshape(1, 1).clone()
    new_scale = scale.detach().clone().reshape(1)
    scale_update(history, new_scale, scaled_max.reshape(1), True)
    return new_scale


def dequantize(x, scale_inv, out) -> None:
    """Twin of torch.ops.graphfp8.dequantize."""
    out.copy_((x.float() * scale_inv.reshape(())).to(out.dtype))


def cast_transpose_dbias(x, scale, out, out_t, scale_inv, amax, dbias, scaled_max=None) -> None:
    """Twin of torch.ops.graphfp8.cast_transpose_dbias: cast_transpose, then the fp32 row sum."""
    cast_transpose(x, scale, out, out_t, scale_inv, amax, scaled_max=scaled_max)
    dbias.copy_(x.float().sum(dim=0).to(dbias.dtype))


def gelu_cast_transpose(x, scale, out, out_t, scale_inv, amax, scaled_max=None) -> None:
    """Twin of torch.ops.graphfp8.gelu_cast_transpose: torch's tanh GELU, then cast_transpose."""
    y = F.gelu(x, approximate="tanh")
    cast_transpose(y, scale, out, out_t, scale_inv, amax, scaled_max=scaled_max)


def dgelu_cast_transpose_dbias(dy, x, scale, out, out_t, scale_inv, amax, dbias,
                               scaled_max=None) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.dgelu_cast_transpose_dbias: torch's tanh gelu_backward, then
    cast_transpose_dbias of the result."""
    dx = torch.ops.aten.gelu_backward(dy, x, approximate="tanh")
    cast_transpose_dbias(dx, scale, out, out_t, scale_inv, amax, dbias, scaled_max)


def glu_cast_transpose(x, activation, scale, out, out_t, scale_inv, amax) -> None:
    """Twin of torch.ops.graphfp8.glu_cast_transpose: graphfp8.ops.glu's math with float64 exp
    and tanh (the CPU kernel's transcendentals), rounded to x's dtype, then cast_transpose."""
    cast_transpose(glu(x, activation, precise=True), scale, out, out_t, scale_inv, amax)


def dglu_cast_transpose_dbias(dy, x, activation, scale, out, out_t, scale_inv, amax,
                              dbias=None) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.dglu_cast_transpose_dbias: dh = graphfp8.ops.dglu (float64
    transcendentals), cast_transpose, and dbias as a sequential float64 column sum rounded to
    float32, then to the dtype (the CPU kernel's order)."""
    dh = dglu(dy, x, activation, precise=True)
    cast_transpose(dh, scale, out, out_t, scale_inv, amax)
    if dbias is not None:
        dbias.copy_(_to_hp(_column_sum(dh.float()), dbias.dtype))


def rope_qkv(qkv, cos, sin, num_heads, inverse, out, num_kv_heads=0) -> None:
    """Twin of torch.ops.graphfp8.rope_qkv: the rotation in float32, each product and sum
    rounded on its own, then rounded to qkv's dtype. A token holds num_heads q heads, then
    num_kv_heads (0: num_heads) k and v heads; the first num_heads + num_kv_heads rotate."""
    b, s, width = qkv.shape
    kv = num_kv_heads or num_heads
    rows = num_heads + 2 * kv
    head_dim = width // rows
    half = head_dim // 2
    x = qkv.view(b, s, rows, head_dim).float()
    c = cos[:s, None, :].float()  # (s, 1, head_dim): broadcast over head rows
    n = sin[:s, None, :].float()
    lo, hi = x[:, :, : num_heads + kv, :half], x[:, :, : num_heads + kv, half:]
    c_lo, c_hi, n_lo, n_hi = c[..., :half], c[..., half:], n[..., :half], n[..., half:]
    if inverse:
        rot = torch.cat([lo * c_lo + hi * n_hi, hi * c_hi - lo * n_lo], dim=-1)
    else:
        rot = torch.cat([lo * c_lo - hi * n_lo, hi * c_hi + lo * n_hi], dim=-1)
    y = torch.cat([rot, x[:, :, num_heads + kv :]], dim=2)
    out.copy_(y.to(out.dtype).view(b, s, width))


# Normalization (LayerNorm / RMSNorm) with an FP8 output, and its backward. Every mean is a
# sequential sum in float64 (a cumsum's last element), divided in float64 and rounded to float32;
# everything else is float32 elementwise math, one rounding per operation: the CPU kernels' order,
# so these twins equal them bit for bit.


def _seq_mean(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean of float32 `v` along `dim`: float64 sequential sum / n, rounded to float32."""
    n = v.shape[dim]
    return (v.double().cumsum(dim).select(dim, n - 1) / n).float()


def _seq_mean_of_products(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Mean of a * b (float32 operands, each product exact in float64), as _seq_mean."""
    n = a.shape[dim]
    return ((a.double() * b.double()).cumsum(dim).select(dim, n - 1) / n).float()


def _to_hp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 v rounded to dtype as the kernels round (torch's scalar conversions): a bf16 NaN is
    0x7FC0, where torch's vectorised CPU conversion writes 0xFFFF."""
    out = v.to(dtype)
    if dtype != torch.bfloat16:
        return out
    bits = torch.where(torch.isnan(v), torch.full_like(out.view(torch.int16), 0x7FC0),
                       out.view(torch.int16))  # fmt: skip
    return bits.view(torch.bfloat16)


def _rsqrt(v: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(v + eps) in float32, each step correctly rounded, as C's sqrtf and the GPU's
    __fsqrt_rn: torch's float32 sqrt on the CPU is not (it was 1 ulp off on ~0.6% of random
    inputs, torch 2.13), its float64 sqrt rounded to float32 is."""
    return 1.0 / torch.sqrt((v + torch.tensor(eps, dtype=torch.float32)).double()).float()


def _norm_weight(gamma: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    g = gamma.float()
    return g + 1.0 if zero_centered_gamma else g


def _norm_input(x, residual, residual_out) -> torch.Tensor:
    """z = x, or round(x + residual) (written to residual_out), as float32."""
    if residual is None:
        return x.float()
    z = _to_hp(x.float() + residual.float(), x.dtype)
    residual_out.copy_(z)
    return z.float()


def _norm_outputs(y, scale, out, out_t, scale_inv, amax, out_hp) -> None:
    _cast_common(y, scale, out, scale_inv, amax)
    if out_t is not None:
        out_t.copy_(out.t())
    if out_hp is not None:
        out_hp.copy_(_to_hp(y, out_hp.dtype))


def layernorm_fp8(x, gamma, beta, eps, zero_centered_gamma, scale, out, out_t, scale_inv, amax,
                  mu, rsigma, out_hp=None, residual=None, residual_out=None,
                  scaled_max=None) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.layernorm_fp8: per row of z (x, or x + residual rounded),
    y = ((z - mu) * rsigma) * g + beta with g = gamma (+ 1), quantized like cast_transpose."""
    amax = _current(scale, amax, scaled_max)
    z = _norm_input(x, residual, residual_out)
    m = _seq_mean(z)
    d = z - m[:, None]
    var = _seq_mean_of_products(d, d)
    rs = _rsqrt(var, eps)
    y = (d * rs[:, None]) * _norm_weight(gamma, zero_centered_gamma) + beta.float()
    mu.copy_(m)
    rsigma.copy_(rs)
    _norm_outputs(y, scale, out, out_t, scale_inv, amax, out_hp)


def rmsnorm_fp8(x, gamma, eps, zero_centered_gamma, scale, out, out_t, scale_inv, amax, rsigma,
                out_hp=None, residual=None, residual_out=None,
                scaled_max=None) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.rmsnorm_fp8: y = (z * rsigma) * g, rsigma = 1 / sqrt(mean(z^2)
    + eps)."""
    amax = _current(scale, amax, scaled_max)
    z = _norm_input(x, residual, residual_out)
    rs = _rsqrt(_seq_mean_of_products(z, z), eps)
    y = (z * rs[:, None]) * _norm_weight(gamma, zero_centered_gamma)
    rsigma.copy_(rs)
    _norm_outputs(y, scale, out, out_t, scale_inv, amax, out_hp)


def _norm_scratch(x, fp8_dtype=torch.float8_e4m3fn):
    rows, hidden = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    return (torch.empty(rows, hidden, dtype=fp8_dtype, device=x.device), torch.empty(1, **f32),
            torch.empty(rows, **f32), torch.empty(rows, **f32))  # fmt: skip


def layernorm_amax(x, gamma, beta, eps, zero_centered_gamma, amax, residual=None) -> None:
    """Twin of torch.ops.graphfp8.layernorm_amax: layernorm_fp8's amax alone."""
    out, scale_inv, mu, rsigma = _norm_scratch(x)
    res_out = torch.empty_like(x) if residual is not None else None
    layernorm_fp8(x, gamma, beta, eps, zero_centered_gamma, torch.ones_like(amax), out, None,
                  scale_inv, amax, mu, rsigma, None, residual, res_out)  # fmt: skip


def rmsnorm_amax(x, gamma, eps, zero_centered_gamma, amax, residual=None) -> None:
    """Twin of torch.ops.graphfp8.rmsnorm_amax: rmsnorm_fp8's amax alone."""
    out, scale_inv, _, rsigma = _norm_scratch(x)
    res_out = torch.empty_like(x) if residual is not None else None
    rmsnorm_fp8(x, gamma, eps, zero_centered_gamma, torch.ones_like(amax), out, None, scale_inv,
                amax, rsigma, None, residual, res_out)  # fmt: skip


def _column_sum(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over rows of float32 `a` (rows, n), or of a * b (each product exact in float64):
    sequential in float64, rounded to float32."""
    if a.shape[0] == 0:
        return a.new_zeros(a.shape[1])
    v = a.double() if b is None else a.double() * b.double()
    return v.cumsum(0)[-1].float()


def _norm_bwd(dy, xhat, rsigma, gamma, zero_centered_gamma, dresidual, dx, dgamma, dbeta, rms):
    dyf = dy.float()
    dyg = dyf * _norm_weight(gamma, zero_centered_gamma)
    c1 = _seq_mean_of_products(dyg, xhat)
    if rms:
        g = dyg - xhat * c1[:, None]
    else:
        g = (dyg - _seq_mean(dyg)[:, None]) - xhat * c1[:, None]
    grad = g * rsigma[:, None]
    if dresidual is not None:
        grad = grad + dresidual.float()
    dx.copy_(_to_hp(grad, dx.dtype))
    dgamma.copy_(_to_hp(_column_sum(dyf, xhat), dgamma.dtype))
    if dbeta is not None:
        dbeta.copy_(_to_hp(_column_sum(dyf), dbeta.dtype))


def layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, dx, dgamma, dbeta,
                  dresidual=None) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.layernorm_bwd: xhat = (x - mu) * rsigma, dyg = dy * g,
    dx = ((dyg - mean(dyg)) - xhat * mean(dyg * xhat)) * rsigma (+ dresidual),
    dgamma = sum_rows dy * xhat, dbeta = sum_rows dy."""
    xhat = (x.float() - mu[:, None]) * rsigma[:, None]
    _norm_bwd(dy, xhat, rsigma, gamma, zero_centered_gamma, dresidual, dx, dgamma, dbeta, False)


def rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma, dx, dgamma, dresidual=None) -> None:
    """Twin of torch.ops.graphfp8.rmsnorm_bwd: xhat = x * rsigma, dx = (dyg - xhat *
    mean(dyg * xhat)) * rsigma (+ dresidual), dgamma = sum_rows dy * xhat."""
    xhat = x.float() * rsigma[:, None]
    _norm_bwd(dy, xhat, rsigma, gamma, zero_centered_gamma, dresidual, dx, dgamma, None, True)


def rope_fp8(qkv, cos, sin, num_heads, scale, out, scale_inv, amax, num_kv_heads=0) -> None:
    """Twin of torch.ops.graphfp8.rope_fp8: rope_qkv (the identity without tables), then one
    cast_to_fp8 per part into q (batch, seq, heads, head_dim), k, v (.., kv_heads, ..)."""
    b, s, width = qkv.shape
    kv = num_kv_heads or num_heads
    rotated = qkv.clone()
    if cos is not None:
        rope_qkv(qkv, cos, sin, num_heads, False, rotated, kv)
    parts = rotated.view(b, s, num_heads + 2 * kv, -1).split([num_heads, kv, kv], dim=2)
    for p in range(3):
        cast_to_fp8(parts[p].contiguous(), scale[p], out[p], scale_inv[p], amax[p])


def rope_fp8_backward(grads, scale_inv, cos, sin, num_heads, out, num_kv_heads=0) -> None:
    """Twin of torch.ops.graphfp8.rope_fp8_backward: each part dequantized in float32 (high
    precision parts: scale_inv [], read as they are), rope_qkv's inverse rotation in float32 on
    the packed gradient, one rounding to out's dtype."""
    b, s, width = out.shape
    scale_inv = scale_inv or [torch.ones(1, device=out.device)] * 3  # [] for high precision
    parts = [g.float() * si.reshape(()) for g, si in zip(grads, scale_inv, strict=True)]
    packed = torch.cat(parts, dim=2).reshape(b, s, width)
    rotated = packed.clone()
    if cos is not None:
        rope_qkv(packed, cos, sin, num_heads, True, rotated, num_kv_heads)
    out.copy_(rotated.to(out.dtype))


def _rope_gradient(grads, cos, sin, num_heads, num_kv_heads):
    """The fused QKV gradient (batch * seq, width) that rope_fp8_backward writes from grads."""
    b, s, _, d = grads[0].shape
    kv = num_kv_heads or num_heads
    g = torch.empty(b, s, (num_heads + 2 * kv) * d, dtype=grads[0].dtype, device=grads[0].device)
    rope_fp8_backward(grads, [], cos, sin, num_heads, g, num_kv_heads)
    return g.view(b * s, -1)


def rope_cast_transpose(grads, cos, sin, num_heads, scale, out, out_t, scale_inv, amax, dbias=None,
                        scaled_max=None, num_kv_heads=0) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.rope_cast_transpose: rope_fp8_backward's gradient, then
    cast_transpose (and the fp32 column sum into dbias)."""
    g = _rope_gradient(grads, cos, sin, num_heads, num_kv_heads)
    cast_transpose(g, scale, out, out_t, scale_inv, amax, scaled_max=scaled_max)
    if dbias is not None:
        dbias.copy_(g.float().sum(dim=0).to(dbias.dtype))


def rope_amax(grads, cos, sin, num_heads, amax, num_kv_heads=0) -> None:
    """Twin of torch.ops.graphfp8.rope_amax: max |g| of rope_cast_transpose's g into amax."""
    g = _rope_gradient(grads, cos, sin, num_heads, num_kv_heads)
    amax.copy_(torch.maximum(amax, abs_max(g).reshape(amax.shape)))


# FP8 cast statistics (graphfp8.numerics) ---------------------------------------------------------


def cast_stats_hp(x, act_in, mu, rsigma, gamma, beta, mode: int, zero_centered_gamma: bool):
    """The float32 tensor that a cast of `mode` quantized (csrc/cast_stats.h's modes)."""
    if mode == 1:  # gelu, rounded to x's dtype as gelu_cast_transpose rounds it
        return F.gelu(x, approximate="tanh").float()
    if mode == 2:  # dgelu: x is dy
        return torch.ops.aten.gelu_backward(x, act_in, approximate="tanh").float()
    if mode in (3, 4):
        g = _norm_weight(gamma, zero_centered_gamma)
        z = x.float()
        if mode == 3:
            z = z - mu[:, None]
        y = (z * rsigma[:, None]) * g
        return y + beta.float() if mode == 3 else y
    return x.float()


def cast_stats(x, act_in, mu, rsigma, gamma, beta, mode, zero_centered_gamma, scale,
               recorded_amax, e4m3, enabled, skip, out) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.cast_stats: the whole reduction in row 0 of out (the kernel
    splits it over the rows; reduce_cast_stats of either gives the same counts and maxima, and
    the sums within float64 rounding), scale and recorded amax in every row."""
    if (enabled is not None and float(enabled.reshape(())) == 0.0) or _skip(skip):
        return
    hp = cast_stats_hp(x, act_in, mu, rsigma, gamma, beta, mode, zero_centered_gamma)
    hp = hp[~torch.isnan(hp)]
    fp8 = torch.float8_e4m3fn if e4m3 else torch.float8_e5m2
    s = scale.reshape(()).float()
    y = hp * s
    q = quantize(hp, scale, fp8).float()
    deq = q * (torch.tensor(1.0, dtype=torch.float32) / s)
    row = [
        hp.abs().amax().double() if hp.numel() else torch.zeros((), dtype=torch.float64),
        (y.abs() > fp8_max(fp8)).sum().double(),
        ((q == 0) & (hp != 0)).sum().double(),
        (hp != 0).sum().double(),
        hp.double().square().sum(),
        (hp.double() - deq.double()).square().sum(),
        s.double(),
        recorded_amax.reshape(()).double(),
    ]
    out.zero_()
    out[0].copy_(torch.stack([r.to(out.device) for r in row]))
    out[:, 6:8] = out[0, 6:8].clone()


def _canonical_nan(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q with every element whose input is NaN as the canonical 0x7F (the torch quantizer keeps
    the sign of some NaNs)."""
    nan_bits = torch.full_like(q.view(torch.uint8), 0x7F)
    return torch.where(torch.isnan(x), nan_bits, q.view(torch.uint8)).view(q.dtype)


def blockwise_quantize(x, out, scale_inv, out_t=None, scale_inv_t=None, block_rows=1,
                       power_2_scale=True, noop=None) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.blockwise_quantize: graphfp8/ops/blockwise.py's torch
    quantizer (torch_quantize) of x and, with out_t, of x.T's tiles (block_rows 1) or the
    blocks transposed (128)."""
    if _skip(noop):
        return
    q, inv = torch_quantize(x, block_rows, out.dtype, power_2_scale)
    out.copy_(_canonical_nan(q, x))
    scale_inv.copy_(inv)
    if out_t is None:
        return
    if block_rows == 1:
        q, inv = torch_quantize(x.t(), 1, out.dtype, power_2_scale)
        out_t.copy_(_canonical_nan(q, x.t()))
    else:
        out_t.copy_(out.t())
        inv = inv.t()
    scale_inv_t.copy_(inv)


def blockwise_norm(x, gamma, beta, eps, zero_centered_gamma, out, scale_inv, out_t, scale_inv_t,
                   mu, rsigma, residual=None, residual_out=None,
                   power_2_scale=True) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.blockwise_norm: the norm's high-precision output (layernorm_fp8
    with beta, else rmsnorm_fp8) quantized by blockwise_quantize in 1x128 tiles."""
    hp = torch.empty_like(x)
    unused, unused_inv, _, _ = _norm_scratch(x, out.dtype)
    one, amax = torch.ones(1, device=x.device), torch.zeros(1, device=x.device)
    if beta is not None:
        layernorm_fp8(x, gamma, beta, eps, zero_centered_gamma, one, unused, None, unused_inv,
                      amax, mu, rsigma, hp, residual, residual_out)  # fmt: skip
    else:
        rmsnorm_fp8(x, gamma, eps, zero_centered_gamma, one, unused, None, unused_inv, amax,
                    rsigma, hp, residual, residual_out)  # fmt: skip
    blockwise_quantize(hp, out, scale_inv, out_t, scale_inv_t, 1, power_2_scale)


def blockwise_stats(x, x_fp8, scale_inv, block_rows, enabled, out) -> None:
    """Twin of torch.ops.graphfp8.blockwise_stats: each block's partial sums (amax, saturated,
    underflow, nonzero, signal, noise, scale_inv) in float64 by torch ops; nothing when enabled
    holds 0. Its sums are in torch's order, the kernel's in element order (close, not equal)."""
    if bool(enabled.reshape(()).item() == 0):
        return
    inv = scale_inv.double()[:, None, :, None]
    xb, qb = _blocks(x.double(), block_rows), _blocks(x_fp8.double(), block_rows)
    a = xb.abs()
    parts = [a.amax(dim=(1, 3)), (a / inv > fp8_max(x_fp8.dtype)).sum(dim=(1, 3)),
             ((xb != 0) & (qb == 0)).sum(dim=(1, 3)), (xb != 0).sum(dim=(1, 3)),
             xb.square().sum(dim=(1, 3)), (xb - qb * inv).square().sum(dim=(1, 3)),
             scale_inv.double()]  # fmt: skip
    out.copy_(torch.stack([t.double() for t in parts], dim=-1).reshape(-1, out.shape[1]))
