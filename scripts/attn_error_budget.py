"""FP8 attention's error budget on the CPU: each of cuDNN's quantization points alone, then all.

Emulates cuDNN's FP8 attention (graphfp8.ops.sdpa_fp8's math) in float64 with every quantization
point switchable, on synthetic causal attention inputs with a trained model's statistics (logit
temperatures from diffuse to sharp, an attention sink, uneven channel and token scales), and
prints the relative error (||x - ref|| / ||ref||) of O, dQ, dK, dV against exact float64
attention, one quantization point at a time. Points (notes/FP8_ATTENTION.md has the results):

    q k v    the FP8 inputs (E4M3, amax scale)      p     P = exp(S - max) at scale 448 (E4M3)
    o        O (E4M3): the output, and D = rowsum(O * dO) of the backward
    do       dO (the backward format)                ds    dS = P (dP - D) (the backward format)
    dqkv     dQ, dK, dV out of the kernel (the backward format; the QKV GEMM casts them again)

    python scripts/attn_error_budget.py [--seq 1024] [--head-dims 64,128] [--heads 4]
    python scripts/attn_error_budget.py --layer    # whole TransformerLayers, SQNR (dB)

`--layer` trains nothing: it runs a bf16 graphfp8.TransformerLayer (seq 512, 4 x 64, 2 x 128,
4 x 128 with 2 KV heads) under FP8 without FP8 attention, with it, and with its E4M3 backward,
after 3 warm-up steps of delayed scaling, and prints the SQNR of the input gradient and of the
QKV and projection weight gradients against the same layer in float32, over 3 batches.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch

import graphfp8 as g8
from graphfp8.fp8.recipe import fp8_max
from graphfp8.reference import quantize
from graphfp8.testing import sqnr

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
POINTS = ("q", "k", "v", "p", "o", "do", "ds", "dqkv")


def fake_quant(x: torch.Tensor, dtype, headroom: float = 1.0, scale=None) -> torch.Tensor:
    """x rounded through `dtype` at scale fp8_max / (amax * headroom) (or the given scale)."""
    if scale is None:
        amax = x.abs().amax().clamp_min(1e-30)
        scale = fp8_max(dtype) / (amax * headroom)
    scale = torch.as_tensor(scale, dtype=torch.float64).reshape(1)
    return quantize(x, scale.float(), dtype).double() / scale


def attention(q, k, v, d_o, quant=(), bwd=E5M2, ds_headroom=1.0, o_bwd=None):
    """(O, dQ, dK, dV) of causal attention over (heads, seq, d) float64 inputs, rounding at the
    points in `quant` like cuDNN (bwd: the backward format; ds_headroom: dS's amax over its
    delayed scale's; o_bwd: "bf16" to keep O in high precision for D)."""
    fq = {n: (lambda x, n=n: fake_quant(x, E4M3) if n in quant else x) for n in "qkv"}
    q, k, v = fq["q"](q), fq["k"](k), fq["v"](v)
    scale = 1 / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    row_sum = p.sum(dim=-1, keepdim=True)
    p_fp8 = fake_quant(p, E4M3, scale=fp8_max(E4M3)) if "p" in quant else p
    o = (p_fp8 @ v) / row_sum
    o_fp8 = fake_quant(o, E4M3) if "o" in quant else o
    stats = m + torch.log(row_sum)
    d_o = fake_quant(d_o, bwd) if "do" in quant else d_o
    pn = torch.exp(s - stats)
    pn_fp8 = fake_quant(pn, E4M3, scale=fp8_max(E4M3)) if "p" in quant else pn
    d_v = pn_fp8.transpose(-1, -2) @ d_o
    d_p = d_o @ v.transpose(-1, -2)
    o_d = o if o_bwd == "bf16" else o_fp8
    delta = (o_d * d_o).sum(dim=-1, keepdim=True)
    d_s = pn * (d_p - delta) * scale
    if "ds" in quant:
        d_s = fake_quant(d_s, bwd, ds_headroom)
    d_q, d_k = d_s @ k, d_s.transpose(-1, -2) @ q
    if "dqkv" in quant:
        d_q, d_k, d_v = (fake_quant(x, bwd) for x in (d_q, d_k, d_v))
    return o_fp8, d_q, d_k, d_v


def inputs(heads: int, seq: int, d: int, seed: int = 0):
    """Synthetic (heads, seq, d) q, k, v, dO: per head a logit temperature (std of q.k/sqrt(d)
    from 1 to 8), every other head with an attention sink at key 0, log-normal channel scales
    (a few outlier channels) and log-normal per-token gradient scales."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def channels():
        return torch.exp(0.75 * randn(heads, 1, d))

    q, k, v = (
        randn(heads, seq, d) * channels(),
        randn(heads, seq, d) * channels(),
        randn(heads, seq, d) * channels(),
    )
    q = q + randn(heads, 1, d) * channels()  # queries share a mean direction
    temps = torch.logspace(0, 3, heads, base=2, dtype=torch.float64)
    for h in range(heads):
        std = ((q[h] @ k[h].T) / math.sqrt(d)).std()
        q[h] *= temps[h] / std
        if h % 2:  # a sink: key 0 along the mean query, 3 temperatures above the rest
            mean_q = q[h].mean(dim=0)
            k[h, 0] = mean_q / mean_q.norm() ** 2 * 3 * temps[h] * math.sqrt(d)
    d_o = randn(heads, seq, d) * torch.exp(randn(heads, seq, 1)) * 1e-3
    return q, k, v, d_o


def rel(x, ref) -> float:
    return float((x - ref).norm() / ref.norm())


def budget(heads: int, seq: int, d: int, rows) -> list[tuple[str, list[float]]]:
    q, k, v, d_o = inputs(heads, seq, d)
    ref = attention(q, k, v, d_o)
    return [(name, [rel(x, r) for x, r in zip(attention(q, k, v, d_o, **kw), ref, strict=True)])
            for name, kw in rows]  # fmt: skip


ROWS = [
    *(
        (f"{p} alone ({'E5M2' if p in ('do', 'ds', 'dqkv') else 'E4M3'})", dict(quant=(p,)))
        for p in POINTS
    ),  # fmt: skip
    ("dqkv alone (E4M3)", dict(quant=("dqkv",), bwd=E4M3)),
    ("do alone (E4M3)", dict(quant=("do",), bwd=E4M3)),
    ("ds alone (E4M3)", dict(quant=("ds",), bwd=E4M3)),
    ("ds alone (E4M3, delayed 16x headroom)", dict(quant=("ds",), bwd=E4M3, ds_headroom=16.0)),
    ("ds alone (E5M2, delayed 16x headroom)", dict(quant=("ds",), ds_headroom=16.0)),
    ("q k v (forward inputs)", dict(quant=("q", "k", "v"))),
    ("all, as shipped (bwd E5M2)", dict(quant=POINTS)),
    ("all, bwd E4M3", dict(quant=POINTS, bwd=E4M3)),
    ("all but dqkv, bwd E5M2", dict(quant=POINTS[:-1])),
]


LAYER_RECIPES = {
    "FP8, bf16 attention": dict(),
    "FP8 attention (E5M2 backward)": dict(fp8_dpa=True, fp8_mha=True),
    "FP8 attention, E4M3 backward": dict(fp8_dpa=True, fp8_mha=True, fp8_dpa_e4m3_bwd=True),
}


def _grads(m, x, dy, recipe=None) -> dict:
    x = x.clone().requires_grad_()
    m.zero_grad()
    with g8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = m(x)
    y.backward(dy)
    wanted = ("qkv.weight", "proj.weight")
    return {"dgrad": x.grad, **{n: p.grad for n, p in m.named_parameters() if n in wanted}}


def layer_sqnrs(heads: int, d: int, groups, seq: int = 512, batch: int = 2) -> dict:
    """{recipe name: {gradient: SQNR dB}} of one TransformerLayer against its float32 copy."""
    torch.manual_seed(0)
    m = g8.TransformerLayer(heads * d, heads, 4 * heads * d, max_seq_len=seq,
                            params_dtype=torch.bfloat16, num_gqa_groups=groups)  # fmt: skip
    m32 = copy.deepcopy(m).float()
    shape = (batch, seq, heads * d)
    batches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(3)]
    refs = [_grads(m32, x.float(), dy.float()) for x, dy in batches]
    out = {}
    for name, kw in LAYER_RECIPES.items():
        recipe, mm = g8.DelayedScaling(amax_history_len=16, **kw), copy.deepcopy(m)
        for _ in range(3):  # delayed scaling: scales from earlier steps
            _grads(mm, *batches[0], recipe)
        got = [_grads(mm, x, dy, recipe) for x, dy in batches]
        out[name] = {
            k: sqnr(torch.cat([r[k].flatten() for r in refs]),
                    torch.cat([g[k].float().flatten() for g in got]))
            for k in refs[0]
        }  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layer", action="store_true", help="TransformerLayer gradients' SQNR")
    args = p.parse_args()
    torch.set_num_threads(2)
    if args.layer:
        for heads, d, groups in ((4, 64, None), (2, 128, None), (4, 128, 2)):
            print(f"\nTransformerLayer {heads} heads x {d}, kv heads {groups or heads}: SQNR dB")
            for name, dbs in layer_sqnrs(heads, d, groups).items():
                print(f"{name:32s} " + " ".join(f"{k} {v:.2f}" for k, v in dbs.items()))
        return
    for d in (int(x) for x in args.head_dims.split(",")):
        print(f"\nseq {args.seq}, head_dim {d}, {args.heads} heads: relative error vs float64")
        print(f"{'quantized':40s} {'O':>8s} {'dQ':>8s} {'dK':>8s} {'dV':>8s}")
        for name, errs in budget(args.heads, args.seq, d, ROWS):
            print(f"{name:40s} " + " ".join(f"{e:8.4f}" for e in errs))


if __name__ == "__main__":
    main()
