"""Attention benchmark: causal attention forward + backward, FP8 (cuDNN, through graphfp8) against
bf16 SDPA (torch's flash kernel), in one process: the attention alone (FP8 ops on FP8 operands),
the layer with its casts (DotProductAttention, bf16 in and out), and the fused-QKV chain of
TransformerLayer (RoPE + attention; FP8 MHA keeps O in FP8), and the bf16 SDPA and FP8 layer as
graphed callables. Device time (CUDA events over
back-to-back calls), host enqueue time, GPU kernel time and kernels per call, and TFLOP/s
(causal: 3.5 x 2 b h s^2 d flops for forward + backward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import graphfp8 as g8
from benchmarks.common import environment, print_table, time_device, time_host
from graphfp8 import ops
from graphfp8.fp8.recipe import fp8_max
from graphfp8.modules._rope import rope_tables
from graphfp8.testing import sdpa_fp8_backward_scales, sdpa_fp8_scales

# (batch, seq, heads, head_dim): the shapes on the GPU, a smoke shape with --quick.
SHAPES = [(4, 2048, 16, 128), (4, 4096, 16, 128)]
QUICK = [(1, 64, 2, 16)]
RECIPES = {
    "dpa": g8.DelayedScaling(amax_history_len=16, fp8_dpa=True),
    "mha": g8.DelayedScaling(amax_history_len=16, fp8_dpa=True, fp8_mha=True),
}


def _quantize(x: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    scale = fp8_max(dtype) / x.abs().amax().float().reshape(1)
    return (x * scale).to(dtype), 1.0 / scale


def _fp8_ops_step(b, s, h, d, device):
    """FP8 attention forward + backward on FP8 operands (the kernels alone)."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    (q, dq), (k, dk), (v, dv) = (
        _quantize(torch.randn(b, s, h, d, device=device), e4m3) for _ in "qkv"
    )
    d_o, ddo = _quantize(torch.randn(b, s, h, d, device=device), e5m2)
    one = torch.ones(1, device=device)
    s_scale = torch.full((1,), 448.0, device=device)
    fwd = sdpa_fp8_scales(dq, dk, dv, s_scale, one)
    amax = [torch.zeros(1, device=device) for _ in range(6)]
    attn_scale = d**-0.5
    o, stats = ops.sdpa_fp8_forward(q, k, v, fwd, amax[0], amax[1], attn_scale)
    fwd["scale_o"] = 448.0 / amax[1]
    bwd = sdpa_fp8_backward_scales(fwd, ddo)
    ops.sdpa_fp8_backward(q, k, v, o, d_o, stats, bwd, amax[2:], attn_scale)
    for name, a in zip(("dp", "dq", "dk", "dv"), amax[2:], strict=True):
        bwd[f"scale_{name}"] = 57344.0 / a.clamp(min=1e-12)
    bwd["descale_dp"] = 1 / bwd["scale_dp"]

    def step():
        out, st = ops.sdpa_fp8_forward(q, k, v, fwd, amax[0], amax[1], attn_scale)
        ops.sdpa_fp8_backward(q, k, v, out, d_o, st, bwd, amax[2:], attn_scale)

    return step


def _peers(b, s, h, d, device) -> dict:
    kw = dict(dtype=torch.bfloat16, device=device)
    q, k, v = (torch.randn(b, s, h, d, **kw).requires_grad_() for _ in "qkv")
    qkv = torch.randn(b, s, 3 * h * d, **kw).requires_grad_()
    dy = torch.randn(b, s, h * d, **kw)
    tables = rope_tables(s, d, 10000.0, torch.float32, device)
    layer = g8.DotProductAttention(h, d, device=device)

    def bf16_sdpa():
        _sdpa_bshd(q, k, v).backward(dy)

    def fp8_layer():
        with g8.fp8_autocast(recipe=RECIPES["dpa"]):
            y = layer(q, k, v)
        y.backward(dy)

    def bf16_chain():
        layer.forward_qkv(qkv, tables).backward(dy)

    def fp8_chain():
        with g8.fp8_autocast(recipe=RECIPES["mha"]):
            y = layer.forward_qkv(qkv, tables)
        y.backward(dy)

    return {
        "bf16 SDPA": bf16_sdpa,
        "fp8 ops": _fp8_ops_step(b, s, h, d, device),
        "fp8 DotProductAttention": fp8_layer,
        "bf16 RoPE + SDPA (fused QKV)": bf16_chain,
        "fp8 MHA chain (fused QKV)": fp8_chain,
        **_graphed_peers((q, k, v), dy, h, d, device),
    }


def _sdpa_bshd(q, k, v):
    """Causal bf16 SDPA on (b, s, h, d) tensors -> (b, s, h * d)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    )
    return out.transpose(1, 2).flatten(2)


def _graphed_peers(qkv, dy, h, d, device) -> dict:
    """The bf16 SDPA and the FP8 layer as graphed callables (one forward and one backward replay
    per call): the attention without the eager layer's host time."""
    sdpa = g8.make_graphed_callables(_sdpa_bshd, qkv, num_warmup_iters=2)
    layer = g8.make_graphed_callables(g8.DotProductAttention(h, d, device=device), qkv,
                                      fp8_enabled=True, fp8_recipe=RECIPES["dpa"],
                                      num_warmup_iters=2)  # fmt: skip

    def step(graphed):
        return lambda: graphed(*qkv).backward(dy)

    return {"bf16 SDPA graphed": step(sdpa), "fp8 DotProductAttention graphed": step(layer)}


def _measure(fn, device, iters: int) -> dict:
    row = {
        "device_ms": time_device(fn, device, warmup=3, iters=iters, repeats=3),
        "host_ms": time_host(fn, device, warmup=1, iters=iters, repeats=3),
    }
    if torch.device(device).type == "cuda":
        from benchmarks.kernel_times import kernel_stats

        stats = kernel_stats(fn, iters=4)
        row["kernels"] = sum(c for c, _ in stats.values())
        row["kernel_ms"] = sum(us for _, us in stats.values()) / 1e3
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][1])[:8]
        row["top_kernels"] = [[name, count, us] for name, (count, us) in ranked]
    return row


def bench_shape(b, s, h, d, device, iters: int) -> dict:
    flops = 3.5 * 2 * b * h * s * s * d  # causal: half of 4 b h s^2 d forward, 2.5x backward
    rows = {name: _measure(fn, device, iters) for name, fn in _peers(b, s, h, d, device).items()}
    for row in rows.values():
        row["tflops"] = flops / row["device_ms"] / 1e9
    return {"shape": [b, s, h, d], "flops": flops, "peers": rows}


def run(device, quick: bool = False) -> dict:
    shapes = QUICK if quick else SHAPES
    iters = 3 if quick else 20
    results = [bench_shape(*shape, device, iters) for shape in shapes]
    names = list(results[0]["peers"])
    key = lambda r: "b{} s{} h{} d{}".format(*r["shape"])  # noqa: E731
    text = print_table(
        "causal attention fwd+bwd, ms per call (CUDA events, back to back)",
        ["shape", *names],
        [[key(r), *[r["peers"][n]["device_ms"] for n in names]] for r in results],
    )
    text += print_table(
        "TFLOP/s (causal fwd+bwd flops / device time)",
        ["shape", *names],
        [[key(r), *[r["peers"][n]["tflops"] for n in names]] for r in results],
    )
    text += print_table(
        "host enqueue ms per call",
        ["shape", *names],
        [[key(r), *[r["peers"][n]["host_ms"] for n in names]] for r in results],
    )
    ratios = [
        [
            key(r),
            r["peers"]["bf16 SDPA"]["device_ms"] / r["peers"]["fp8 ops"]["device_ms"],
            r["peers"]["bf16 SDPA"]["device_ms"]
            / r["peers"]["fp8 DotProductAttention"]["device_ms"],
            r["peers"]["bf16 RoPE + SDPA (fused QKV)"]["device_ms"]
            / r["peers"]["fp8 MHA chain (fused QKV)"]["device_ms"],
            r["peers"]["bf16 SDPA graphed"]["device_ms"]
            / r["peers"]["fp8 DotProductAttention graphed"]["device_ms"],
        ]
        for r in results
    ]
    text += print_table(
        "speedup over bf16 (> 1 is faster; target for the attention: >= 1.25x)",
        ["shape", "fp8 ops / bf16 SDPA", "fp8 layer / bf16 SDPA", "fp8 MHA chain / bf16 chain",
         "graphed fp8 layer / graphed bf16 SDPA"],
        ratios,
    )  # fmt: skip
    return {"env": environment(device), "shapes": results, "table": text}
