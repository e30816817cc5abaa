"""Speed at the shapes people train (issue 41): whole-model training steps of graphfp8-train's
runs - the compiled plain-torch bf16 model (the fair baseline), graphfp8's bf16 and FP8 layer
graphs and FP8 with the whole step as one graph - in one process on the same data, with repeats
and their spread, model TFLOP/s, the physical floor (training/floor.py, ceilings calibrated on
the GPU) and the fraction of it reached, GPU busy (kernel time over the unprofiled wall) and the
full kernel table by category and by kernel group against its part of the floor (`python -m
benchmarks.floor_gap` reads it back from the JSON).

    python -m benchmarks speed [--quick] [--json PATH]   (--quick: tiny shapes, CPU too)

Rows (GPU): llama-100m (B8 x S1024), llama-1b with 4 layers (B2 x S4096), llama-8b with 2 layers
(B1 x S8192), each over the byte data's 256-token vocabulary (the blocks dominate, as in issue
41's block measurements; _row_config says why).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import torch

from benchmarks.common import environment, print_table, sync
from benchmarks.floor_gap import gap_table
from graphfp8.training.data import Dataset
from graphfp8.training.floor import H200, Ceilings, calibrate, floor, model_flops
from graphfp8.training.kernel_table import kernel_table
from graphfp8.training.model import PRESETS
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream
from graphfp8.training.speed import peer_labels, spread
from graphfp8.training.trace_stats import kernel_events

__all__ = ["ROWS", "PEERS", "measure_peer", "run"]

# (preset, shape overrides, microbatches per step, also FP8 with --stage-batches)
ROWS = [("llama-100m", {}, 4, True), ("llama-1b", {"layers": 4}, 2, False),
        ("llama-8b", {"layers": 2}, 2, False)]  # fmt: skip
QUICK_ROWS = [("llama-tiny", {"layers": 1, "batch": 2, "seq_len": 32}, 1, True)]
# (precision, graphs, staged batches); the first is the baseline. FP8 with the whole step as one
# graph too: nothing runs between replays (the layer graphs' idle, notes/PERF.md's floor gap).
PEERS = [("bf16", "compile", False), ("bf16", "layers", False), ("fp8", "layers", False),
         ("fp8", "step", False)]  # fmt: skip
STAGED = ("fp8", "layers", True)  # issue 41's host idle: the next step's batches copied ahead


def selected_rows() -> list:
    """ROWS, or those whose preset SPEED_ROWS names (comma-separated: a shorter GPU call)."""
    names = os.environ.get("SPEED_ROWS")
    if not names:
        return ROWS
    wanted = names.split(",")
    unknown = set(wanted) - {r[0] for r in ROWS}
    if unknown:
        rows = [r[0] for r in ROWS]
        raise ValueError(f"SPEED_ROWS names no row {sorted(unknown)}; rows: {rows}")
    return [r for r in ROWS if r[0] in wanted]


BASELINE = "bf16-torch-compile"


@dataclasses.dataclass(frozen=True)
class Timing:
    warmup: int = 3  # steps before timing (compile and capture happen in the first)
    steps: int = 4  # optimizer steps per repeat
    repeats: int = 3
    profile_steps: int = 2  # steps under torch.profiler (GPU only), after the repeats


def measure_peer(spec: RunSpec, data: Dataset, timing: Timing, ceilings: Ceilings) -> dict:
    """One peer: its steady tokens/s over `repeats` timed windows, then (GPU) a profile.

    Returns:
        {"name", "peer" (labels), "prepare_s", "tokens_per_s" (spread over the repeats),
        "ms_per_step" (median), "model_tflops", "floor_ms", "floor_fraction", "busy" (kernel
        union over the unprofiled wall), "busy_profiled" (over the profiled steps' wall),
        "kernel_table" (GPU) or None, "losses" (the last step's)}.
    """
    total = timing.warmup + timing.steps * timing.repeats + timing.profile_steps
    t0 = time.perf_counter()
    run = Run(spec, data)
    run.prepare()
    for _ in range(timing.warmup):
        run.train_step(total)
    sync(spec.device)
    prepare_s = time.perf_counter() - t0
    tokens_per_step = spec.tokens_per_microbatch * spec.microbatches
    rates = []
    for _ in range(timing.repeats):
        start = time.perf_counter()
        for _ in range(timing.steps):
            loss = run.train_step(total)
        sync(spec.device)
        rates.append(tokens_per_step * timing.steps / (time.perf_counter() - start))
    tps = spread(rates)
    step_ms = tokens_per_step / tps["median"] * 1e3
    f = floor(spec.model, spec.precision, tokens_per_step, ceilings)
    table = _profile(run, timing.profile_steps, total) if spec.device.startswith("cuda") else None
    flops = model_flops(spec.model, tokens_per_step)["total"]
    return {"name": spec.name, "peer": peer_labels(spec), "prepare_s": prepare_s,
            "tokens_per_s": tps, "ms_per_step": step_ms,
            "model_tflops": flops / (step_ms / 1e3) / 1e12,
            "floor_ms": {k: v * 1e3 for k, v in f.items() if k != "ceilings"},
            "floor_fraction": f["total"] * 1e3 / step_ms,
            "busy": table["busy_ms"] / step_ms if table else None,
            "busy_profiled": table["busy_ms"] / table["wall_ms"] if table else None,
            "kernel_table": table, "loss": float(loss)}  # fmt: skip


def _profile(run: Run, steps: int, total: int) -> dict:
    """kernel_table of `steps` steps of `run` under torch.profiler (CUDA activity only), with
    "wall_ms": the profiled steps' own wall per step. Busy over the unprofiled wall read above 1
    in session 6; busy over this wall tells whether the profiler slowed the kernels
    (docs/benchmarking.md, "The floor")."""
    from torch.profiler import ProfilerActivity, profile

    sync(run.spec.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            run.train_step(total)
        sync(run.spec.device)
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in kernel_events(prof)]
    return {**kernel_table(kernels, steps), "wall_ms": wall_ms}


def _row_config(preset: str, overrides: dict, vocab: int):
    """The preset's blocks with the data's vocabulary (bytes: 256), not Llama 3's 128256: the
    rows measure the blocks at the shapes people train, as issue 41's targets do (with Llama's
    head, its bf16 GEMM is half the floor of a 2-layer 8B model: graphfp8-train --preset
    llama-8b --layers 2 runs that whole model)."""
    return dataclasses.replace(PRESETS[preset], vocab=vocab, **overrides)


def _fresh(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch._dynamo.reset()  # the previous peer's compiled model holds its weights
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bench_row(preset: str, overrides: dict, microbatches: int, staged: bool, device: str,
              timing: Timing, data: Dataset) -> dict:  # fmt: skip
    """Every peer of PEERS (and STAGED when `staged`) on one shape, one after the other, on the
    same data; each peer's ratios to the baseline."""
    cfg = _row_config(preset, overrides, data.vocab_size)
    ceilings = H200
    if device.startswith("cuda"):
        ceilings = calibrate(device, (cfg.batch, cfg.seq_len, cfg.heads, cfg.kv_heads or
                                      cfg.heads, cfg.head_dim))  # fmt: skip
    peers = {}
    for precision, graphs, stage in PEERS + ([STAGED] if staged else []):
        spec = RunSpec(preset, cfg, precision, graphs, microbatches, device, stage_batches=stage)
        peers[spec.name] = measure_peer(spec, data, timing, ceilings)
        _fresh(device)
    for p in peers.values():
        p["baseline"] = BASELINE
        p["vs_baseline"] = ratio(p, peers[BASELINE])
    return {"preset": preset, "overrides": overrides, "model": cfg.to_dict(),
            "microbatches": microbatches, "tokens_per_step": cfg.batch * cfg.seq_len *
            microbatches, "ceilings": ceilings.to_dict(), "peers": peers}  # fmt: skip


def ratio(a: dict, b: dict) -> dict:
    """tokens/s of peer a over peer b: the medians' ratio and its range over the repeats."""
    ta, tb = a["tokens_per_s"], b["tokens_per_s"]
    return {"median": ta["median"] / tb["median"], "min": ta["min"] / tb["max"],
            "max": ta["max"] / tb["min"]}  # fmt: skip


def run(device, quick: bool = False) -> dict:
    device = str(device)
    timing = Timing(warmup=1, steps=1, repeats=3, profile_steps=1) if quick else Timing()
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16 if quick else 16 << 20),
                   val_fraction=0.0)  # fmt: skip
    rows, text = [], ""
    for row in QUICK_ROWS if quick else selected_rows():  # each row's tables printed as it finishes
        rows.append(bench_row(*row, device, timing, data))
        text += _tables(rows[-1])
    return {"env": environment(device), "timing": dataclasses.asdict(timing), "rows": rows,
            "table": text}  # fmt: skip


def _fmt_spread(s: dict, digits: str = ",.0f") -> str:
    return f"{s['median']:{digits}} ({s['min']:{digits}}-{s['max']:{digits}})"


def _shape(r: dict) -> str:
    m = r["model"]
    return (f"{r['preset']} ({m['layers']} layers, B{m['batch']} x S{m['seq_len']}, "
            f"{r['microbatches']} microbatches)")  # fmt: skip


def _tables(r: dict) -> str:
    """One row's peers (speed, ratios, floor, busy), then its kernel table by category and by
    kernel group against the floor's part for each (benchmarks/floor_gap.py)."""
    c = r["ceilings"]
    header = ["peer", "graphed", "compiled", "attention", "tokens/s median (min-max)",
              f"/ {BASELINE} (min-max)", "/ bf16-graphs", "model TFLOP/s", "ms / step",
              "floor ms", "of floor", "GPU busy"]  # fmt: skip
    lines = []
    for name, p in r["peers"].items():
        own = ratio(p, r["peers"]["bf16-graphs"])["median"]
        lines.append([name, p["peer"]["graphed"], p["peer"]["compiled"], p["peer"]["attention"],
                      _fmt_spread(p["tokens_per_s"]), _fmt_spread(p["vs_baseline"], ".3f"), own,
                      p["model_tflops"], p["ms_per_step"], p["floor_ms"]["total"],
                      p["floor_fraction"], "-" if p["busy"] is None else p["busy"]])  # fmt: skip
    text = print_table(
        f"{_shape(r)}: whole training steps, {r['tokens_per_step']} tokens each; floor at "
        f"FP8 {c['fp8_gemm_tflops']:.0f} / bf16 {c['bf16_gemm_tflops']:.0f} TFLOP/s, copy "
        f"{c['copy_tbps']:.2f} TB/s, attention {c['attention_tflops']:.0f} TFLOP/s "
        f"({c['source']})", header, lines)  # fmt: skip
    return text + _kernel_rows(r) + gap_table(r)


def _kernel_rows(r: dict) -> str:
    """Kernel time per step by category beside the floor's part it is measured against."""
    peers = {n: p for n, p in r["peers"].items() if p["kernel_table"]}
    if not peers:
        return ""
    cats = list(next(iter(peers.values()))["kernel_table"]["categories"])
    part = {"gemm": "blocks_gemm+head_gemm", "attention": "attention"}
    rows = []
    for cat in cats:
        row = [cat, part.get(cat, "memory")]
        for p in peers.values():
            k = p["kernel_table"]["categories"][cat]
            row.append(f"{k['ms']:.3f} ({k['launches']:.0f})")
        rows.append(row)
    rows.append(["all kernels / busy (union)", "-",
                 *[f"{p['kernel_table']['kernel_ms']:.3f} / {p['kernel_table']['busy_ms']:.3f}"
                   for p in peers.values()]])  # fmt: skip
    rows.append(["profiled wall / unprofiled wall", "-",
                 *[f"{p['kernel_table']['wall_ms']:.3f} / {p['ms_per_step']:.3f}"
                   for p in peers.values()]])  # fmt: skip
    rows.append(["floor: gemm / attention / memory", "-",
                 *[f"{p['floor_ms']['blocks_gemm'] + p['floor_ms']['head_gemm']:.3f} / "
                   f"{p['floor_ms']['attention']:.3f} / {p['floor_ms']['memory']:.3f}"
                   for p in peers.values()]])  # fmt: skip
    return print_table(
        f"{r['preset']}: kernel ms per step by category (launches per step); "
        "every kernel is in one row",
        ["category", "floor part", *peers],
        rows,
    )
