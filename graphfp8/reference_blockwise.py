"""Pure-PyTorch float64 twins of the blockwise FP8 quantizers and GEMM (graphfp8/ops/blockwise.py),
written tile by tile: what tests compare the package's quantizers against, bit for bit; and the
twins of the activation with a blockwise output (torch.ops.graphfp8.blockwise_act) and of the
MLP activation and its gradient in the input dtype (torch.ops.graphfp8.mlp_act, mlp_dact)."""

from __future__ import annotations

import math

import torch

from graphfp8.ops.glu import dglu, glu

__all__ = [
    "act_values",
    "block_stats",
    "blockwise_act",
    "dequantize",
    "gemm",
    "mlp_act",
    "mlp_dact",
    "quantize",
]

_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FLT_MAX = torch.finfo(torch.float32).max


def _scale(amax: float, fp8_dtype, power_2_scale: bool) -> float:
    """The scale of one tile (docs/fp8.md, "Blockwise scaling"): float64 division rounded to
    float32 (the correctly rounded float32 quotient), floored to a power of 2 by frexp."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    s = _MAX[fp8_dtype] / amax
    s = float(torch.tensor(s, dtype=torch.float64).to(torch.float32))
    s = min(s, _FLT_MAX)
    if power_2_scale:
        s = math.ldexp(1.0, math.frexp(s)[1] - 1)
    return s


def quantize(x: torch.Tensor, rows: int, fp8_dtype=torch.float8_e4m3fn, power_2_scale=True):
    """x (R, C) in tiles of `rows` x 128 (rows 1: 1x128 tiles, 128: 128x128 blocks). Returns
    (x_fp8 (R, C), scale_inv (ceil(R / rows), ceil(C / 128)) float32)."""
    r, c = x.shape
    x64 = x.double()
    out = torch.empty(r, c, dtype=fp8_dtype)
    inv = torch.empty(-(-r // rows), -(-c // 128), dtype=torch.float32)
    limit = _MAX[fp8_dtype]
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            tile = x64[i * rows : (i + 1) * rows, j * 128 : (j + 1) * 128]
            s = _scale(float(tile.abs().max()), fp8_dtype, power_2_scale)
            q = (tile * s).clamp(-limit, limit)
            out[i * rows : (i + 1) * rows, j * 128 : (j + 1) * 128] = q.to(fp8_dtype)
            inv[i, j] = float(torch.tensor(1.0 / s, dtype=torch.float64).to(torch.float32))
    return out, inv


def dequantize(x_fp8: torch.Tensor, scale_inv: torch.Tensor, rows: int) -> torch.Tensor:
    """(R, C) float64: each element times its tile's scale_inv."""
    out = x_fp8.double()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * rows : (i + 1) * rows, j * 128 : (j + 1) * 128] *= float(scale_inv[i, j])
    return out


def gemm(a_fp8, a_scale_inv, b_fp8, b_scale_inv, b_rows: int) -> torch.Tensor:
    """(M, N) float64 = dequantized a (1x128 tiles) @ dequantized b (b_rows x 128).T."""
    return dequantize(a_fp8, a_scale_inv, 1) @ dequantize(b_fp8, b_scale_inv, b_rows).t()


def block_stats(x: torch.Tensor, rows: int, fp8_dtype=torch.float8_e4m3fn, power_2_scale=True):
    """The twin of graphfp8.ops.blockwise_stats.block_stats for x quantized by `quantize` above,
    block by block in float64: a dict of its STATS."""
    x_fp8, inv = quantize(x, rows, fp8_dtype, power_2_scale)
    x64, q64 = x.double(), x_fp8.double()
    out = dict.fromkeys(("saturated", "underflow", "nonzero", "signal", "noise",
                         "saturated_blocks", "underflow_blocks"), 0.0)  # fmt: skip
    out["amax"], worst, logs = float(x64.abs().max()), 0.0, []
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            at = (slice(i * rows, (i + 1) * rows), slice(j * 128, (j + 1) * 128))
            xb, qb, s_inv = x64[at], q64[at], float(inv[i, j])
            sat = int(((xb.abs() / s_inv) > _MAX[fp8_dtype]).sum())
            under = int(((xb != 0) & (qb == 0)).sum())
            signal, noise = float(xb.square().sum()), float((xb - qb * s_inv).square().sum())
            out["saturated"] += sat
            out["underflow"] += under
            out["nonzero"] += int((xb != 0).sum())
            out["signal"] += signal
            out["noise"] += noise
            out["saturated_blocks"] += sat > 0
            out["underflow_blocks"] += under > 0
            if signal > 0:
                worst = max(worst, math.sqrt(noise / signal))
            logs.append(-math.log2(s_inv))
    out["worst_block_rel_err"] = worst
    out["log2_scale_min"], out["log2_scale_max"] = min(logs), max(logs)
    out["log2_scale_mean"] = sum(logs) / len(logs)
    return out


def act_values(x: torch.Tensor, activation: str) -> torch.Tensor:
    """a = act(x) in x's dtype as the CPU kernel computes it (csrc/blockwise_act.h):
    graphfp8.ops.glu with float64 transcendentals (the CPU GLU kernels'), GELU as GeGLU's gate
    (u = 1: the product is exact)."""
    if activation == "gelu":
        return glu(torch.cat([x, torch.ones_like(x)], dim=-1), "geglu", precise=True)
    return glu(x, activation, precise=True)


def blockwise_act(x, activation, out, scale_inv, out_t=None, scale_inv_t=None,
                  power_2_scale=True) -> None:  # fmt: skip
    """Twin of torch.ops.graphfp8.blockwise_act: act_values, then `quantize` in 1x128 tiles (and
    a.T's with out_t)."""
    a = act_values(x, activation)
    q, inv = quantize(a.cpu(), 1, out.dtype, power_2_scale)
    out.copy_(q)
    scale_inv.copy_(inv)
    if out_t is not None:
        q, inv = quantize(a.t().cpu(), 1, out.dtype, power_2_scale)
        out_t.copy_(q)
        scale_inv_t.copy_(inv)


def mlp_act(x, activation):
    """Twin of torch.ops.graphfp8.mlp_act: a (rows, F) in x's dtype, act_values (the CPU kernel's
    math, which blockwise_act quantizes)."""
    return act_values(x, activation)


def mlp_dact(dy, x, activation):
    """Twin of torch.ops.graphfp8.mlp_dact: dx in x's dtype by graphfp8.ops.dglu with float64
    transcendentals (the CPU GLU kernels'); GELU's as GeGLU's dg with u = 1 (da * 1 is exact)."""
    if activation == "gelu":
        return dglu(dy, torch.cat([x, torch.ones_like(x)], dim=-1), "geglu", precise=True)[
            :, : x.shape[1]
        ]
    return dglu(dy, x, activation, precise=True)
