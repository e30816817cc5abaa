"""What the carried recipe's safe weight casts cost (docs/fp8.md, "The carried recipe"): a model
carrying its recipe casts its FP8 weights on every microbatch (is_first_microbatch=None), where
the hand-written loop casts on each step's first of 4 microbatches only (True, then False).

    python -m benchmarks carried-casts [--quick] [--device cpu]

Per shape - the 100m preset's 8 blocks (hidden 1024, GELU), one Llama 3.2 1B block (hidden 2048,
32 heads, 8 kv heads, SwiGLU 8192) and one Llama 3.1 8B block (hidden 4096, SwiGLU 14336), 8192
tokens each; --quick: tiny shapes for a CPU smoke run - forward + backward per microbatch, eager
and graphed (make_graphed_callables, weight caching on), both schedules in one process: ms per
microbatch over 4-microbatch steps, the ratio recast / cached, and graphfp8 ops per microbatch
(eager, a dispatch-mode count).
"""

from __future__ import annotations

import itertools
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphfp8 as g8
from benchmarks.common import environment, print_table, time_device

MICRO = 4
RECIPE = g8.DelayedScaling(amax_history_len=16)
# name: (hidden, heads, kv heads, ffn, layers, activation, norm, tokens as (batch, seq))
SHAPES = {
    "100m preset (8 blocks)": (1024, 16, 16, 4096, 8, "gelu", "LayerNorm", (8, 1024)),
    "Llama 1B block": (2048, 32, 8, 8192, 1, "swiglu", "RMSNorm", (4, 2048)),
    "Llama 8B block": (4096, 32, 8, 14336, 1, "swiglu", "RMSNorm", (4, 2048)),
}
QUICK = {
    "tiny (2 blocks)": (64, 4, 4, 256, 2, "gelu", "LayerNorm", (2, 64)),
    "tiny Llama block": (128, 4, 2, 352, 1, "swiglu", "RMSNorm", (2, 64)),
}
SCHEDULES = {"cached": lambda i: i % MICRO == 0, "recast (carried)": lambda i: None}


class Stack(nn.Module):
    def __init__(self, shape, device):
        super().__init__()
        hidden, heads, kv, ffn, layers, act, norm, (_, seq) = shape
        self.layers = nn.ModuleList(
            g8.TransformerLayer(hidden, heads, ffn, max_seq_len=seq, bias=False, activation=act,
                                normalization=norm, num_gqa_groups=kv,
                                params_dtype=torch.bfloat16, device=device)
            for _ in range(layers)
        )  # fmt: skip

    def forward(self, x, is_first_microbatch=None):
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.namespace)] += 1
        return func(*args, **(kwargs or {}))


def _microbatch(model, x, dy, schedule, fp8: bool):
    counter = itertools.count()

    def step():
        flag = schedule(next(counter))
        with g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
            y = model(x, is_first_microbatch=flag)
        y.backward(dy)

    return step


def _graphed_microbatch(graphed, x, dy, schedule):
    counter = itertools.count()

    def step():
        graphed(x, is_first_microbatch=schedule(next(counter))).backward(dy)

    return step


def bench_shape(shape, device, iters: int, repeats: int) -> dict:
    batch, seq = shape[-1]
    model = Stack(shape, device)
    x = torch.randn(batch, seq, shape[0], dtype=torch.bfloat16, device=device,
                    requires_grad=True)  # fmt: skip
    dy = torch.randn_like(x)
    row = {}
    for name, schedule in SCHEDULES.items():
        step = _microbatch(model, x, dy, schedule, True)
        row[f"eager {name} ms"] = time_device(
            step, device, warmup=MICRO, iters=iters * MICRO, repeats=repeats
        )
        with _OpCount() as count:
            for _ in range(MICRO):
                step()
        row[f"eager {name} graphfp8 ops"] = count.ops["graphfp8"] / MICRO
        row[f"eager {name} ops"] = sum(count.ops.values()) / MICRO
    graphed = g8.make_graphed_callables(Stack(shape, device), (x,), fp8_enabled=True,
                                        fp8_recipe=RECIPE, fp8_weight_caching=True)  # fmt: skip
    for name, schedule in SCHEDULES.items():
        step = _graphed_microbatch(graphed, x, dy, schedule)
        row[f"graphed {name} ms"] = time_device(
            step, device, warmup=MICRO, iters=iters * MICRO, repeats=repeats
        )
    for mode in ("eager", "graphed"):
        row[f"{mode} ratio"] = row[f"{mode} recast (carried) ms"] / row[f"{mode} cached ms"]
    return row


def run(device, quick: bool = False) -> dict:
    shapes = QUICK if quick else SHAPES
    iters = 1 if torch.device(device).type == "cpu" else 5
    repeats = 1 if quick else 5
    rows = {name: bench_shape(shape, device, iters, repeats) for name, shape in shapes.items()}
    keys = ["eager cached ms", "eager recast (carried) ms", "eager ratio", "graphed cached ms",
            "graphed recast (carried) ms", "graphed ratio", "eager cached graphfp8 ops",
            "eager recast (carried) graphfp8 ops"]  # fmt: skip
    text = print_table(
        f"carried recipe: weight casts on every microbatch (recast) against step-first only "
        f"(cached), fwd+bwd per microbatch, {MICRO} microbatches per step, {device}",
        ["shape", *keys],
        [[name, *[row[k] for k in keys]] for name, row in rows.items()],
    )
    return {"env": environment(device), "shapes": rows, "table": text}
