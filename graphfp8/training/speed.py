"""The speed fields of a run (summary.json and the printed table): tokens/s with its spread, model
TFLOP/s, the physical floor and the fraction of it reached, the peer's labels, and the baseline
every ratio is taken against (docs/benchmarking.md, "The floor")."""

from __future__ import annotations

import statistics

from graphfp8.training.floor import H200, Ceilings, floor, model_flops
from graphfp8.training.run import RunSpec

__all__ = ["baseline_of", "name_baseline", "peer_labels", "speed_fields", "spread"]


def spread(samples: list[float]) -> dict | None:
    """{"min", "median", "max", "n"} of repeated measurements (None without any)."""
    if not samples:
        return None
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples),
            "n": len(samples)}  # fmt: skip


def peer_labels(spec: RunSpec) -> dict:
    """What kind of peer a run is: graphed or not, compiled or not, its attention."""
    cuda = spec.device.startswith("cuda")
    if spec.graphs == "compile":
        compiled, attention = "whole model", "SDPA (fused on a GPU)"
    else:
        compiled = "embedding and loss" if spec.compile else "no"
        attention = "cuDNN FP8" if spec.fp8_attention else "cuDNN bf16" if cuda else "bf16 (CPU)"
    return {"graphed": {"layers": "blocks", "step": "whole step"}.get(spec.graphs, "no"),
            "compiled": compiled, "attention": attention}  # fmt: skip


def speed_fields(spec: RunSpec, tokens_per_s: float | None, interval_rates: list[float],
                 world: int = 1, ceilings: Ceilings = H200) -> dict:  # fmt: skip
    """A run's speed fields: "tokens_per_s_spread" (over the steady log intervals),
    "model_tflops" (per GPU), "floor" (seconds per optimizer step per GPU, by part),
    "floor_fraction" (the floor over the measured step time) and "peer" (peer_labels)."""
    tokens_per_step = spec.tokens_per_microbatch * spec.microbatches  # one GPU's
    f = floor(spec.model, spec.precision, tokens_per_step, ceilings)
    out = {"tokens_per_s_spread": spread(interval_rates), "floor": f, "peer": peer_labels(spec),
           "model_tflops": None, "floor_fraction": None}  # fmt: skip
    if tokens_per_s:
        per_gpu = tokens_per_s / world
        flops_per_token = model_flops(spec.model, 1)["total"]
        out["model_tflops"] = flops_per_token * per_gpu / 1e12
        out["floor_fraction"] = f["total"] / (tokens_per_step / per_gpu)
    return out


def baseline_of(results: list[dict]) -> dict:
    """The run every ratio is against: the compiled bf16 run when there is one, else the first."""
    return next((r for r in results if r.get("graphs") == "compile"), results[0])


def name_baseline(results: list[dict]) -> str:
    """Writes into every run its "baseline" (the name of baseline_of's run) and "speedup" (its
    tokens/s over the baseline's; None when either was not timed). Returns the baseline's
    name."""
    base = baseline_of(results)
    for r in results:
        timed = r.get("tokens_per_s") and base.get("tokens_per_s")
        r["baseline"] = base["name"]
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if timed else None
    return base["name"]
