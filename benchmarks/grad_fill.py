"""The layer graphs' gradient accumulation four ways in one process (issue 41, notes/PERF.md,
"Gradient accumulation at Llama shapes"): the default (-0.0 fill as zero + negate, then an add
on every microbatch), GRAPHFP8_GRAD_FILL_ONE_PASS (the fill as one fill_ per buffer),
GRAPHFP8_GRAD_FOLD_COPY_FIRST (no fill of the large buffers, the first microbatch's fold a
copy) and GRAPHFP8_WGRAD_INTO_GRAD (the FP8 weights' wgrad GEMMs write .grad themselves, beta 0
then 1: no fill, dW or add for them; other bits than the default, rounded once). Whole training
steps of FP8 layer graphs at the Llama-3.2-1B (4 layers, B2 x S4096) and Llama-3-8B (2 layers,
B1 x S8192) rows of `benchmarks speed`, the runs captured side by side (the switches are read at
capture) and timed in rotating windows, with the kernel time of the gradient accumulation family
(benchmarks/floor_gap.py) from one profiled step each.

    python -m benchmarks grad-fill [--quick] [--json PATH]
"""

from __future__ import annotations

import contextlib
import time

from benchmarks import speed
from benchmarks.common import env_var, environment, print_table, sync
from benchmarks.floor_gap import group_of
from graphfp8.training.data import Dataset
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream
from graphfp8.training.speed import spread

__all__ = ["VARIANTS", "run"]

# variant -> the switch it turns on (the others off); the first is the baseline
VARIANTS = {"default": None, "fill-one-pass": "GRAD_FILL_ONE_PASS",
            "copy-first": "GRAD_FOLD_COPY_FIRST", "wgrad-into-grad": "WGRAD_INTO_GRAD"}  # fmt: skip
GROUP = "grad accumulation (-0.0 fill, adds)"


@contextlib.contextmanager
def _switches(on: str | None):
    with contextlib.ExitStack() as stack:
        for name in filter(None, VARIANTS.values()):
            stack.enter_context(env_var("GRAPHFP8_" + name, "1" if name == on else "0"))
        yield


def bench_row(row: tuple, device: str, steps: int, repeats: int, data: Dataset) -> dict:
    """One shape: each variant's tokens/s over `repeats` windows of `steps` steps (the order
    rotating), its ratio to the default (medians, with the range), its final loss (the same
    bits as the default's where the run is deterministic, but wgrad-into-grad's) and (GPU) the
    family's kernel ms."""
    preset, overrides, microbatches, _ = row
    cfg = speed._row_config(preset, overrides, data.vocab_size)
    warmup, total = 3, 3 + len(VARIANTS) * steps * repeats + 2
    runs = {}
    for name, on in VARIANTS.items():
        with _switches(on):
            runs[name] = Run(RunSpec(preset, cfg, "fp8", "layers", microbatches, device), data)
            runs[name].prepare()
            for _ in range(warmup):
                runs[name].train_step(total)
    sync(device)
    tokens = runs["default"].spec.tokens_per_microbatch * microbatches
    names = list(VARIANTS)
    rates, losses = {n: [] for n in names}, {}
    for rep in range(repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            for _ in range(steps):
                loss = runs[name].train_step(total)
            sync(device)
            rates[name].append(tokens * steps / (time.perf_counter() - start))
            losses[name] = float(loss)
    base = spread(rates["default"])
    out = {"preset": preset, "overrides": overrides, "tokens_per_step": tokens, "variants": {}}
    for name in names:
        tps = spread(rates[name])
        out["variants"][name] = {
            "tokens_per_s": tps, "vs_default": tps["median"] / base["median"],
            "vs_default_min": tps["min"] / base["max"], "vs_default_max": tps["max"] / base["min"],
            "final_loss": losses[name]}  # fmt: skip
        if device.startswith("cuda"):
            kernels = speed._profile(runs[name], 1, total)["kernels"]
            ms = sum(k["us"] for k in kernels if group_of(k["name"], k["category"]) == GROUP)
            out["variants"][name]["grad_accumulation_ms"] = ms / 1e3
    return out


def run(device, quick: bool = False) -> dict:
    device = str(device)
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16 if quick else 16 << 20),
                   val_fraction=0.0)  # fmt: skip
    rows = speed.QUICK_ROWS if quick else speed.ROWS[1:]
    steps, repeats = (1, 3) if quick else (4, 6)
    results = [bench_row(r, device, steps, repeats, data) for r in rows]
    lines = []
    for r in results:
        for name, v in r["variants"].items():
            lines.append([r["preset"], name, v["tokens_per_s"]["median"],
                          f"{v['vs_default']:.4f} ({v['vs_default_min']:.4f}-"
                          f"{v['vs_default_max']:.4f})",
                          f"{v.get('grad_accumulation_ms', float('nan')):.3f}",
                          f"{v['final_loss']:.6f}"])  # fmt: skip
    text = print_table(
        f"gradient accumulation of FP8 layer graphs, one process, {repeats} rotating windows of "
        f"{steps} steps, {device}",
        ["row", "variant", "tokens/s median", "/ default (min-max)", "grad accumulation ms",
         "final loss"],
        lines,
    )  # fmt: skip
    return {"env": environment(device), "rows": results, "table": text}
