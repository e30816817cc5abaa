"""Activation recompute at the Llama-3-8B block shapes (h 4096, 32 heads, 8 KV heads, SwiGLU
14336, B1 x S8192; --quick: tiny shapes): a stack of FP8 TransformerLayers with recompute none,
selective and full - the activation memory a forward keeps for its backward (torch.cuda's
allocated bytes after the forward, less before; LiveBytes on the CPU) against the planner's
(graphfp8/memory/plan_activations.py), and the step time of forward + backward through
make_graphed_callables, each as a ratio to no recompute measured in the same process. Targets
(issue 40): full keeps <= 1/4 of the activations at <= 1.35x the step time, selective <= 1.1x."""

from __future__ import annotations

import gc

import torch
from torch import nn

import graphfp8 as g8
from benchmarks.common import environment, print_table, sync, time_device
from graphfp8.memory import LiveBytes
from graphfp8.memory.plan_activations import layer_activation_bytes
from graphfp8.memory.shapes import LLAMA

MODES = ("none", "selective", "full")
RECIPE = g8.DelayedScaling(amax_history_len=16)


def _stack(shape, layers: int, seq: int, mode: str, device) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        g8.TransformerLayer(shape.hidden, shape.heads, shape.ffn, num_gqa_groups=shape.kv_heads,
                            activation=shape.activation, normalization=shape.norm,
                            bias=shape.bias, max_seq_len=seq, params_dtype=torch.bfloat16,
                            device=device, recompute=mode)
        for _ in range(layers)
    ])  # fmt: skip


def _kept_bytes(stack, x) -> int:
    """Bytes the forward allocates and keeps for the backward (its output not counted)."""
    with g8.fp8_autocast(recipe=RECIPE):  # slots and FP8 weight casts first
        stack(x).sum().backward()
    if x.is_cuda:
        sync(x.device)
        before = torch.cuda.memory_allocated(x.device)
        with g8.fp8_autocast(recipe=RECIPE):
            y = stack(x)
        kept = torch.cuda.memory_allocated(x.device) - before - y.untyped_storage().nbytes()
    else:
        with LiveBytes() as live:
            with g8.fp8_autocast(recipe=RECIPE):
                y = stack(x)
            kept = live.live - y.untyped_storage().nbytes()
    y.sum().backward()
    return kept


def _step_ms(stack, x, device) -> float:
    graphed = g8.make_graphed_callables(stack, (x,), fp8_enabled=True, fp8_recipe=RECIPE,
                                        fp8_weight_caching=True)  # fmt: skip
    dy = torch.randn_like(x)

    def step():
        graphed(x, is_first_microbatch=False).backward(dy)

    with g8.fp8_autocast(recipe=RECIPE):
        graphed(x, is_first_microbatch=True).backward(dy)
    return time_device(step, device, warmup=3, iters=5 if x.is_cuda else 2, repeats=3)


def run(device, quick: bool = False) -> dict:
    device = torch.device(device)
    shape, seq, layers = LLAMA["llama-8b"], 8192, 4
    if quick:
        shape = shape.__class__(hidden=64, heads=4, kv_heads=2, ffn=176, layers=2, vocab=256)
        seq, layers = 32, 2
    rows, results = [], {}
    for mode in MODES:
        g8.reset_state()
        stack = _stack(shape, layers, seq, mode, device)
        x = torch.randn(1, seq, shape.hidden, dtype=torch.bfloat16, device=device,
                        requires_grad=True)  # fmt: skip
        kept = _kept_bytes(stack, x)
        planned = layers * layer_activation_bytes(shape, seq, mode, first=True)
        results[mode] = {"kept_bytes": kept, "planned_bytes": planned,
                         "step_ms": _step_ms(stack, x, device)}  # fmt: skip
        del stack, x
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["none"]
    for mode, r in results.items():
        r["memory_ratio"] = r["kept_bytes"] / base["kept_bytes"]
        r["time_ratio"] = r["step_ms"] / base["step_ms"]
        rows.append([mode, f"{r['kept_bytes'] / 2**20:.1f}", f"{r['planned_bytes'] / 2**20:.1f}",
                     f"{r['memory_ratio']:.3f}", f"{r['step_ms']:.2f}",
                     f"{r['time_ratio']:.3f}"])  # fmt: skip
    title = (f"activation recompute, {layers} layers h {shape.hidden} heads {shape.heads}/"
             f"{shape.kv_heads} F {shape.ffn}, 1 x {seq} tokens, FP8 (graphed step time); "
             "targets: full memory <= 0.25 at time <= 1.35, selective time <= 1.10")  # fmt: skip
    header = ["recompute", "kept MiB", "planned MiB", "memory / none", "step ms", "time / none"]
    table = print_table(title, header, rows)
    return {"env": environment(device), "results": results, "table": table}
