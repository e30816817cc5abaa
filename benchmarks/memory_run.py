"""One memory run: a stack of graphfp8.TransformerLayers trained for a few steps of gradient
accumulation in one mode (bf16 or FP8, eager or graphed), with the memory report taken at the end
of the last forward (every saved activation alive, the .grad buffers filled: the footprint's
peak) and torch.cuda's counters after the last step.

    python -m benchmarks.memory_run '{"hidden": 2048, "precision": "fp8", "graphs": true}'

runs one mode in this process and prints its result as one JSON line (what `bench memory
--table` does once per mode, each in its own process)."""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from dataclasses import asdict, dataclass

import torch
from torch import nn

import graphfp8 as g8
from graphfp8.memory import LiveBytes, cuda_counters, memory_report
from graphfp8.modules import cache_weight_transposes

__all__ = ["Shape", "Stack", "run_mode"]

RECIPE = g8.DelayedScaling()


@dataclass(frozen=True)
class Shape:
    """The model and microbatch: `layers` TransformerLayers, input (batch, seq, hidden)."""

    hidden: int
    layers: int = 4
    batch: int = 4
    seq: int = 2048
    heads: int | None = None  # default hidden / 128, at least 1
    ffn: int | None = None  # default 4 * hidden

    @property
    def num_heads(self) -> int:
        return self.heads or max(1, self.hidden // 128)

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden


class Stack(nn.Module):
    """TransformerLayers called in order, as graphfp8-train's blocks: (B, S, H) -> (B, S, H)."""

    def __init__(self, shape: Shape, device):
        super().__init__()
        self.layers = nn.ModuleList(
            g8.TransformerLayer(
                shape.hidden,
                shape.num_heads,
                shape.ffn_hidden,
                max_seq_len=shape.seq,
                params_dtype=torch.bfloat16,
                device=device,
            )  # fmt: skip
            for _ in range(shape.layers)
        )

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


def run_mode(
    shape: Shape, precision: str, graphs: bool, device, steps: int = 2, microbatches: int = 4,
    warmup: int = 3, transpose_cache: bool = True, fp8_weights: bool = False,
) -> dict:  # fmt: skip
    """Trains `steps` optimizer steps of `microbatches` microbatches (plain SGD, zero_grad with
    set_to_none; transpose_cache=False: graphfp8.modules.cache_weight_transposes(model, False);
    fp8_weights=True: the model built inside fp8_model_init, SGD on MasterWeights' fp32 masters,
    which the report counts under "other")
    and returns {"report": MemoryReport at the end of the last forward, "after_steps":
    torch.cuda counters after the last step (None on the CPU), "live_peak": on the CPU in eager
    mode the LiveBytes peak of the last microbatch (what it allocated, saved activations and
    transients, at most at once), else None}."""
    device = torch.device(device)
    g8.reset_state()
    torch.manual_seed(0)
    with g8.fp8_model_init(enabled=fp8_weights):
        model = Stack(shape, device)
    cache_weight_transposes(model, transpose_cache)
    masters = g8.MasterWeights(model) if fp8_weights else None
    opt = torch.optim.SGD(masters.parameters() if masters else model.parameters(), lr=1e-6)
    held = {f"master {i}": m for i, m in enumerate(masters.masters)} if masters else {}
    fp8 = precision == "fp8"
    x = torch.randn(shape.batch, shape.seq, shape.hidden, dtype=torch.bfloat16, device=device,
                    requires_grad=True)  # fmt: skip
    dy = torch.randn_like(x)
    graphed = None
    if graphs:
        graphed = g8.make_graphed_callables(
            model, (x,), fp8_enabled=fp8, fp8_recipe=RECIPE, fp8_weight_caching=True,
            num_warmup_iters=warmup,
        )  # fmt: skip
    for step in range(steps):
        for mb in range(microbatches):
            last = step == steps - 1 and mb == microbatches - 1
            # The CPU's peak: LiveBytes over the last eager microbatch (a tape's replay
            # allocates as it copies, so it says nothing about a graph).
            live = LiveBytes() if last and graphed is None and device.type == "cpu" else None
            with live or contextlib.nullcontext():
                if graphed is not None:
                    y = graphed(x, is_first_microbatch=mb == 0)
                else:
                    with g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
                        y = model(x, is_first_microbatch=mb == 0)
                if last:
                    other = {"x": x, "x.grad": x.grad, "dy": dy, **held}
                    report = memory_report(model, outputs=y, graphed=[graphed] if graphed else (),
                                           other=other)  # fmt: skip
                y.backward(dy)
                del y
        if masters is not None:
            masters.step(opt)
            masters.zero_grad(set_to_none=True)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        x.grad = None
    after = cuda_counters(device) if device.type == "cuda" else None
    return {"report": report, "after_steps": after, "live_peak": live.peak if live else None}


def release(device) -> None:
    """Frees what a finished run left behind (graph pools included) and resets the peaks."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv=None) -> None:
    """Worker: one mode from a JSON argument; prints {"shape", "precision", "graphs",
    "after_steps", "report"} as one JSON line."""
    args = json.loads((argv or sys.argv[1:])[0])
    shape = Shape(**{k: args[k] for k in ("hidden", "layers", "batch", "seq") if k in args})
    device = args.get("device", "cuda" if torch.cuda.is_available() else "cpu")
    steps, microbatches = args.get("steps", 2), args.get("microbatches", 4)
    out = run_mode(shape, args["precision"], args["graphs"], device, steps, microbatches,
                   transpose_cache=args.get("transpose_cache", True),
                   fp8_weights=args.get("fp8_weights", False))  # fmt: skip
    result = {"shape": asdict(shape), "precision": args["precision"], "graphs": args["graphs"],
              "transpose_cache": args.get("transpose_cache", True),
              "after_steps": out["after_steps"],
              "report": out["report"].to_dict(with_items=False)}  # fmt: skip
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
