"""Memory benchmark: where the memory of one TransformerLayer and of a stack of four goes, bf16
beside FP8, eager beside graphed (graphfp8.memory's report: parameters, grads, FP8 weights,
arenas, graph buffers and pools or tapes, and every autograd node's saved tensors), and with
--table the measurement of issue 19: each mode in its own process, torch.cuda.memory_reserved()
after 2 steps of 4 microbatches and the peak allocated, at hidden 2048 and 4096."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from graphfp8.bench.common import environment, print_table
from graphfp8.bench.memory_run import Shape, release, run_mode
from graphfp8.memory import CATEGORIES

__all__ = ["run", "run_table"]

MODES = [("bf16", False), ("bf16", True), ("fp8", False), ("fp8", True)]
GiB, MiB = 2**30, 2**20
# Targets of issue 19: FP8 graphed reserved / bf16 graphed reserved, per hidden size.
TARGETS = {2048: 1.0, 4096: 0.85}


def _name(precision: str, graphs: bool) -> str:
    return f"{precision} {'graphed' if graphs else 'eager'}"


def run(device, quick: bool = False, table: bool = False) -> dict:
    """The reports (one layer, the stack) in this process; with table=True the per-process
    table instead (CUDA)."""
    if table:
        return run_table(device, quick=quick)
    if quick:
        shapes = [Shape(64, layers=1, batch=2, seq=32, heads=2), Shape(64, 2, 2, 32, heads=2)]
    else:
        shapes = [Shape(2048, layers=1), Shape(2048, layers=4)]
    results, text = [], ""
    for shape in shapes:
        row = {"shape": vars(shape), "modes": {}}
        reports = {}
        for precision, graphs in MODES:
            out = run_mode(shape, precision, graphs, device, steps=1 if quick else 2,
                           microbatches=2 if quick else 4, warmup=1 if quick else 3)  # fmt: skip
            name = _name(precision, graphs)
            reports[name] = out["report"]
            row["modes"][name] = {"after_steps": out["after_steps"],
                                  "report": out["report"].to_dict()}  # fmt: skip
            del out
            release(device)
        text += _compare(shape, reports)
        if shape.layers == 1:
            for name in ("bf16 eager", "fp8 eager"):
                text += reports[name].format(f"{name}, one layer: what each node saves")
                print(reports[name].format(f"{name}, one layer"), flush=True)
        results.append(row)
    return {"env": environment(device), "results": results, "table": text}


def _compare(shape: Shape, reports: dict) -> str:
    """Categories in rows, modes in columns, MiB; CUDA counters below."""
    names = list(reports)
    rows = []
    for cat in CATEGORIES:
        if any(r.bytes.get(cat) for r in reports.values()):
            rows.append([cat, *[reports[n].bytes.get(cat, 0) / MiB for n in names]])
    rows.append(["total (each storage once)", *[reports[n].total / MiB for n in names]])
    if all(r.cuda for r in reports.values()):
        for key in ("allocated", "reserved", "max_allocated", "max_reserved"):
            rows.append([f"torch.cuda {key}", *[reports[n].cuda[key] / MiB for n in names]])
        rows.append(["graph pools reserved",
                     *[sum(p["reserved"] for k, p in reports[n].pools.items() if k != "default")
                       / MiB for n in names]])  # fmt: skip
    title = (f"memory at the end of the last forward, MiB: {shape.layers} TransformerLayer(s), "
             f"hidden {shape.hidden}, batch {shape.batch} x seq {shape.seq}")  # fmt: skip
    return print_table(title, ["", *names], rows)


def run_table(device, quick: bool = False, hiddens=(2048, 4096)) -> dict:
    """Issue 19's table: 4 TransformerLayers, batch 4 x seq 2048, heads hidden/128, ffn 4 hidden,
    each mode in its own process; memory_reserved after 2 steps of 4 microbatches (peak
    allocated beside it), and FP8 graphed / bf16 graphed against the targets."""
    shapes = [Shape(64, 4, 2, 32, heads=2)] if quick else [Shape(h) for h in hiddens]
    results = []
    for shape in shapes:
        row = {"shape": vars(shape), "modes": {}}
        for precision, graphs in MODES:
            row["modes"][_name(precision, graphs)] = _subprocess(shape, precision, graphs, device)
        results.append(row)
    text = _table_text(results)
    return {"env": environment(device), "results": results, "table": text}


def _subprocess(shape: Shape, precision: str, graphs: bool, device) -> dict:
    args = dict(vars(shape), precision=precision, graphs=graphs, device=str(device))
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "graphfp8.bench.memory_run", json.dumps(args)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table_text(results) -> str:
    names = [_name(p, g) for p, g in MODES]
    rows, ratios = [], []
    for r in results:
        modes, hidden = r["modes"], r["shape"]["hidden"]
        rows.append([hidden, *[_cell(modes[n]) for n in names]])
        fg, bg = modes["fp8 graphed"].get("after_steps"), modes["bf16 graphed"].get("after_steps")
        fe, be = modes["fp8 eager"].get("after_steps"), modes["bf16 eager"].get("after_steps")
        if fg and bg and fe and be:
            ratio = fg["reserved"] / bg["reserved"]
            target = TARGETS.get(hidden)
            ratios.append([hidden, ratio, target if target else "-",
                           "met" if target and ratio <= target else "missed" if target else "-",
                           fe["reserved"] / be["reserved"]])  # fmt: skip
    s = results[0]["shape"]
    text = print_table(
        f"memory_reserved after 2 steps of 4 microbatches, GiB (peak allocated); one process "
        f"per mode; {s['layers']} TransformerLayers, batch {s['batch']} x seq {s['seq']}",
        ["hidden", *names],
        rows,
    )
    if ratios:
        text += print_table("FP8 / bf16 reserved", ["hidden", "graphed", "target", "",
                                                     "eager"], ratios)  # fmt: skip
    return text


def _cell(mode: dict) -> str:
    after = mode.get("after_steps")
    if not after:
        return mode.get("error", "-")
    return f"{after['reserved'] / GiB:.2f} ({after['max_allocated'] / GiB:.2f})"
