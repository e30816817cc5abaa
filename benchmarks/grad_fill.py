"""GRAPHFP8_GRAD_FILL_ONE_PASS off / on in one process (issue 41, notes/PERF.md, "Gradient
accumulation at Llama shapes"): whole training steps of FP8 layer graphs at the Llama-3.2-1B
(4 layers, B2 x S4096) and Llama-3-8B (2 layers, B1 x S8192) rows of `benchmarks speed`, the two
runs captured side by side (the switch is read at capture) and timed in alternating windows, with
the kernel time of the gradient accumulation group (benchmarks/floor_gap.py) from one profiled
step each.

    python -m benchmarks grad-fill [--quick] [--json PATH]
"""

from __future__ import annotations

import time

from benchmarks import speed
from benchmarks.common import env_var, environment, print_table, sync
from benchmarks.floor_gap import group_of
from graphfp8.training.data import Dataset
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream
from graphfp8.training.speed import spread

__all__ = ["run"]

SWITCH = "GRAPHFP8_GRAD_FILL_ONE_PASS"
GROUP = "grad accumulation (-0.0 fill, adds)"


def _runs(preset: str, overrides: dict, microbatches: int, device: str, data: Dataset,
          warmup: int, total: int) -> dict:  # fmt: skip
    """{False: the run captured with the switch off, True: on}, both past their warm-up."""
    cfg = speed._row_config(preset, overrides, data.vocab_size)
    runs = {}
    for on in (False, True):
        with env_var(SWITCH, "1" if on else "0"):
            run = Run(RunSpec(preset, cfg, "fp8", "layers", microbatches, device), data)
            run.prepare()
            for _ in range(warmup):
                run.train_step(total)
        runs[on] = run
    sync(device)
    return runs


def bench_row(row: tuple, device: str, steps: int, repeats: int, data: Dataset) -> dict:
    """One shape: tokens/s of both runs over `repeats` alternating windows of `steps` steps,
    the on / off ratio of the medians and its range, both final losses (the same bits where the
    run is deterministic: the fill writes the same -0.0), and (GPU) the group's kernel ms per
    step."""
    preset, overrides, microbatches, _ = row
    warmup, total = 3, 3 + 2 * steps * repeats + 2
    runs = _runs(preset, overrides, microbatches, device, data, warmup, total)
    tokens = runs[False].spec.tokens_per_microbatch * microbatches
    rates, losses = {False: [], True: []}, {}
    for rep in range(repeats):
        for on in (rep % 2 == 1, rep % 2 == 0):  # alternate which goes first
            start = time.perf_counter()
            for _ in range(steps):
                loss = runs[on].train_step(total)
            sync(device)
            rates[on].append(tokens * steps / (time.perf_counter() - start))
            losses[on] = float(loss)
    tps = {on: spread(r) for on, r in rates.items()}
    out = {"preset": preset, "overrides": overrides, "tokens_per_step": tokens,
           "off_tokens_per_s": tps[False], "on_tokens_per_s": tps[True],
           "on_vs_off": tps[True]["median"] / tps[False]["median"],
           "on_vs_off_min": tps[True]["min"] / tps[False]["max"],
           "on_vs_off_max": tps[True]["max"] / tps[False]["min"],
           "final_loss_off": losses[False], "final_loss_on": losses[True]}  # fmt: skip
    if device.startswith("cuda"):
        for on in (False, True):
            table = speed._profile(runs[on], 1, total)
            kernels = table["kernels"]
            ms = sum(k["us"] for k in kernels if group_of(k["name"], k["category"]) == GROUP)
            out[f"{'on' if on else 'off'}_grad_accumulation_ms"] = ms / 1e3
    return out


def run(device, quick: bool = False) -> dict:
    device = str(device)
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16 if quick else 16 << 20),
                   val_fraction=0.0)  # fmt: skip
    rows = speed.QUICK_ROWS if quick else speed.ROWS[1:]
    steps, repeats = (1, 2) if quick else (4, 4)
    results = [bench_row(r, device, steps, repeats, data) for r in rows]
    text = print_table(
        f"{SWITCH} off / on, FP8 layer graphs, one process, {repeats} alternating windows of "
        f"{steps} steps, {device}",
        ["row", "off tokens/s median", "on tokens/s median", "on / off (min-max)",
         "grad accumulation ms off / on", "final loss off / on"],
        [[r["preset"], r["off_tokens_per_s"]["median"], r["on_tokens_per_s"]["median"],
          f"{r['on_vs_off']:.4f} ({r['on_vs_off_min']:.4f}-{r['on_vs_off_max']:.4f})",
          f"{r.get('off_grad_accumulation_ms', float('nan')):.3f} / "
          f"{r.get('on_grad_accumulation_ms', float('nan')):.3f}",
          f"{r['final_loss_off']:.6f} / {r['final_loss_on']:.6f}"] for r in results],
    )  # fmt: skip
    return {"env": environment(device), "rows": results, "table": text}
