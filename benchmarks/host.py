"""Host benchmark: the host (CPU) time one call of each graphed entry point costs, at 1, 8 and 24
layers of residual FP8 MLP blocks (x + LayerNormMLP(x)), beside torch.cuda.make_graphed_callables
of the same bf16 model (GPU) - issue 26's targets, docs/benchmarking.md.

    peer                        one call
    g8 callable                 make_graphed_callables of the whole stack: forward + backward
    g8 per-layer               one graphed callable per block, chained by hand (copies between)
    g8 per-layer chain         the same with chain=True (no copy between blocks)
    g8 microbatch graph         make_graphed_microbatch: one call
    g8 step graph               make_graphed_step, 2 microbatches: one call (and launch_only())
    torch callable / per-layer  torch.cuda.make_graphed_callables of the bf16 twin (GPU only)
    autograd floor              an empty autograd.Function, forward + backward: the engine alone

Host time is the enqueue time with the device synchronised before each call (common.time_host).
On the CPU the tape replays its ops inside that time, so each row also runs with the replay
switched off (graphs.backends.tape_replays_off): "checks" is the host work alone, "replay" the
rest.

    python -m benchmarks host [--quick] [--json PATH]
"""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from benchmarks.common import environment, print_table, time_host
from benchmarks.peers import TorchMLP
from graphfp8.graphs.backends import tape_replays_off

RECIPE = g8.DelayedScaling()
LAYERS = (1, 8, 24)
MICROBATCHES = 2  # per step of the step graph


class Block(nn.Module):
    """x + LayerNormMLP(x): the residual inside, so that blocks chain."""

    def __init__(self, hidden: int, device, torch_twin: bool = False):
        super().__init__()
        kw = dict(dtype=torch.bfloat16, device=device)
        self.mlp = (TorchMLP(hidden, **kw) if torch_twin else
                    g8.LayerNormMLP(hidden, 4 * hidden, params_dtype=torch.bfloat16,
                                    device=device))  # fmt: skip
        self.fp8 = not torch_twin

    def forward(self, x, is_first_microbatch=None):
        if self.fp8:
            return x + self.mlp(x, is_first_microbatch=is_first_microbatch)
        return x + self.mlp(x)


def _stack(hidden, layers, device, torch_twin=False) -> nn.Sequential:
    return nn.Sequential(*(Block(hidden, device, torch_twin) for _ in range(layers)))


def _mse(y, target):
    return F.mse_loss(y.float(), target.float())


def _data(hidden, tokens, device):
    x = torch.randn(MICROBATCHES, tokens, hidden, dtype=torch.bfloat16, device=device)
    return x, torch.randn_like(x)


def _g8_callable(hidden, tokens, layers, device):
    x, dy = _data(hidden, tokens, device)
    xin = x[0].clone().requires_grad_()
    g = g8.make_graphed_callables(_stack(hidden, layers, device), (xin,), fp8_enabled=True,
                                  fp8_recipe=RECIPE, fp8_weight_caching=True)  # fmt: skip
    g(xin, is_first_microbatch=True).backward(dy[0])
    return lambda: g(xin, is_first_microbatch=False).backward(dy[0])


def _g8_per_layer(hidden, tokens, layers, device, chain: bool):
    x, dy = _data(hidden, tokens, device)
    blocks = tuple(_stack(hidden, layers, device))
    samples = tuple((x[0].clone().requires_grad_(),) for _ in blocks)
    graphed = g8.make_graphed_callables(blocks, samples, fp8_enabled=True, fp8_recipe=RECIPE,
                                        fp8_weight_caching=True, chain=chain)  # fmt: skip
    xin = samples[0][0]

    def call(first=False):
        h = xin
        for g in graphed:
            h = g(h, is_first_microbatch=first)
        h.backward(dy[0])

    call(True)
    return call


def _g8_microbatch(hidden, tokens, layers, device):
    x, target = _data(hidden, tokens, device)
    g = g8.make_graphed_microbatch(_stack(hidden, layers, device), _mse, (x[0], target[0]),
                                   fp8_enabled=True, fp8_recipe=RECIPE,
                                   fp8_weight_caching=True)  # fmt: skip
    g((x[0], target[0]), is_first_microbatch=True)
    return lambda: g((x[0], target[0]), is_first_microbatch=False)


def _adamw(model, device):
    kind = dict(capturable=True) if torch.device(device).type == "cuda" else dict(fused=True)
    return torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-4, device=device), **kind)


def _g8_step(hidden, tokens, layers, device):
    model = _stack(hidden, layers, device)
    batch = _data(hidden, tokens, device)
    step = g8.make_graphed_step(model, _mse, _adamw(model, device), batch, MICROBATCHES,
                                fp8_enabled=True, fp8_recipe=RECIPE)  # fmt: skip
    run = lambda: step(batch)  # noqa: E731
    run.launch_only = step.launch_only
    return run


def _torch_callable(hidden, tokens, layers, device):
    x, dy = _data(hidden, tokens, device)
    xin = x[0].clone().requires_grad_()
    g = torch.cuda.make_graphed_callables(_stack(hidden, layers, device, torch_twin=True), (xin,))
    return lambda: g(xin).backward(dy[0])


def _torch_per_layer(hidden, tokens, layers, device):
    x, dy = _data(hidden, tokens, device)
    blocks = tuple(_stack(hidden, layers, device, torch_twin=True))
    samples = tuple((x[0].clone().requires_grad_(),) for _ in blocks)
    graphed = torch.cuda.make_graphed_callables(blocks, samples)
    xin = samples[0][0]

    def call():
        h = xin
        for g in graphed:
            h = g(h)
        h.backward(dy[0])

    return call


class _Empty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def _autograd_floor(hidden, tokens, layers, device):
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    return lambda: _Empty.apply(x).backward(dy)


PEERS = {
    "g8 callable": _g8_callable,
    "g8 per-layer": lambda *a: _g8_per_layer(*a, chain=False),
    "g8 per-layer chain": lambda *a: _g8_per_layer(*a, chain=True),
    "g8 microbatch graph": _g8_microbatch,
    "g8 step graph": _g8_step,
    "torch callable": _torch_callable,
    "torch per-layer": _torch_per_layer,
    "autograd floor": _autograd_floor,
}
_GPU_ONLY = ("torch callable", "torch per-layer")


def _us(fn, device, quick: bool) -> float:
    iters, repeats = (3, 1) if quick else (50, 5)
    return time_host(fn, device, warmup=3, iters=iters, repeats=repeats) * 1e3


def _measure(call, device, quick: bool) -> dict:
    """Host µs per call; on the CPU also with the tape's replay off (the checks alone). The step
    graph's launch_only() beside it (on the CPU with the replay off too)."""
    row = {"host_us": _us(call, device, quick), "checks_us": None, "launch_us": None}
    launch = getattr(call, "launch_only", None)
    if torch.device(device).type == "cpu":
        with tape_replays_off():
            row["checks_us"] = _us(call, device, quick)
            if launch is not None:
                row["launch_us"] = _us(launch, device, quick)
    elif launch is not None:
        row["launch_us"] = _us(launch, device, quick)
    return row


def run(device, quick: bool = False) -> dict:
    cuda = torch.device(device).type == "cuda"
    # The host time does not depend on the token count; 1024 keeps the GPU part of a call short.
    hidden, tokens = (1024, 1024) if cuda and not quick else (32, 16)
    counts = (1, 2) if quick else LAYERS
    rows = []
    for layers in counts:
        for name, make in PEERS.items():
            if name in _GPU_ONLY and not cuda:
                continue
            if name == "autograd floor" and layers != counts[0]:
                continue
            torch.manual_seed(0)
            call = make(hidden, tokens, layers, device)
            rows.append({"peer": name, "layers": layers, **_measure(call, device, quick)})
            del call
            gc.collect()  # the captures of this peer (module <-> graphs cycles) go now
            if cuda:
                torch.cuda.empty_cache()
    text = _tables(rows, hidden, tokens, counts, cuda)
    return {"env": environment(device), "hidden": hidden, "tokens": tokens,
            "microbatches_per_step": MICROBATCHES, "rows": rows, "table": text}  # fmt: skip


def _fmt(v):
    return "-" if v is None else v


def _tables(rows, hidden, tokens, counts, cuda: bool) -> str:
    header = ["peer", "layers", "host µs / call", "host µs / layer"]
    header += ["of which launch_only"] if cuda else ["checks µs (replay off)", "replay µs"]
    body = []
    for r in rows:
        per_layer = r["host_us"] / r["layers"] if "per-layer" in r["peer"] else None
        extra = [_fmt(r["launch_us"])] if cuda else [
            _fmt(r["checks_us"]), r["host_us"] - r["checks_us"]]  # fmt: skip
        body.append([r["peer"], r["layers"], r["host_us"], _fmt(per_layer), *extra])
    title = f"host time per call, h={hidden} T={tokens} ({'GPU' if cuda else 'CPU tape'})"
    text = print_table(title, header, body)
    by = {(r["peer"], r["layers"]): r for r in rows}
    key = "host_us" if cuda else "checks_us"
    flat = [[p, by[(p, counts[-1])][key] / by[(p, counts[0])][key]]
            for p in ("g8 callable", "g8 microbatch graph", "g8 step graph")]  # fmt: skip
    text += print_table(f"host at {counts[-1]} layers / host at {counts[0]} layer (target <= 1.2)",
                        ["peer", "ratio"], flat)  # fmt: skip
    steps = [[n, by[("g8 step graph", n)]["launch_us"],
              by[("g8 step graph", n)][key] - by[("g8 step graph", n)]["launch_us"]]
             for n in counts]  # fmt: skip
    text += print_table(
        "g8 step graph: launch_only() and the Python around it per step, µs (target: Python <= 25)",
        ["layers", "launch µs", "Python µs"],
        steps,
    )
    if cuda:
        gaps = [[n, by[(f"g8 {k}", n)]["host_us"] - by[(f"torch {k}", n)]["host_us"]]
                for k in ("callable",) for n in counts]  # fmt: skip
        gaps += [[f"{n} (per layer)", (by[("g8 per-layer chain", n)]["host_us"]
                  - by[("torch per-layer", n)]["host_us"]) / n] for n in counts]  # fmt: skip
        text += print_table(
            "graphfp8 - torch.cuda.make_graphed_callables, host µs (targets: "
            "callable <= 30, per layer <= 15)",
            ["layers", "gap µs"],
            gaps,
        )
    return text
