"""Memory benchmark: where the memory of one TransformerLayer and of a stack of four goes, bf16
beside FP8, eager beside graphed (graphfp8.memory's report: parameters, grads, FP8 weights,
arenas, graph buffers and pools or tapes, and every autograd node's saved tensors), and with
--table the measurement of issue 19: each mode in its own process, torch.cuda.memory_reserved()
after 2 steps of 4 microbatches and the peak allocated, at hidden 2048 and 4096. Then bytes per
parameter per GPU, sharded and unsharded (benchmarks/memory_shard.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import memory_shard
from benchmarks.common import environment, print_table
from benchmarks.memory_run import Shape, release, run_mode
from graphfp8.memory import CATEGORIES

__all__ = ["run", "run_table"]

MODES = {
    "bf16 eager": dict(precision="bf16", graphs=False),
    "bf16 graphed": dict(precision="bf16", graphs=True),
    "fp8 eager": dict(precision="fp8", graphs=False),
    "fp8 graphed": dict(precision="fp8", graphs=True),
    # graphfp8.modules.cache_weight_transposes(model, False): the backward transposes the
    # cached FP8 weights instead of keeping their transposes.
    "fp8 graphed, w.T in bwd": dict(precision="fp8", graphs=True, transpose_cache=False),
    # Issue 16: FP8 primary weights (fp8_model_init) with fp32 masters (MasterWeights).
    "fp8 graphed, FP8 weights": dict(precision="fp8", graphs=True, fp8_weights=True),
}
GiB, MiB = 2**30, 2**20
# Targets of issue 19: FP8 graphed reserved / bf16 graphed reserved, per hidden size.
TARGETS = {2048: 1.0, 4096: 0.85}


def run(device, quick: bool = False, table: bool = False) -> dict:
    """The reports (one layer, the stack) in this process; with table=True the per-process
    table instead (CUDA)."""
    if table:
        return run_table(device, quick=quick)
    if quick:
        shapes = [Shape(64, layers=2, batch=2, seq=32, heads=2)]
    else:
        shapes = [Shape(2048, layers=1), Shape(2048, layers=4)]
    results, text = [], ""
    for shape in shapes:
        row = {"shape": vars(shape), "modes": {}}
        reports, lives = {}, {}
        for name, mode in MODES.items():
            out = run_mode(shape, **mode, device=device, steps=1 if quick else 2,
                           microbatches=2 if quick else 4, warmup=1 if quick else 3)  # fmt: skip
            reports[name] = out["report"]
            row["modes"][name] = {"after_steps": out["after_steps"], "live_peak": out["live_peak"],
                                  "report": out["report"].to_dict()}  # fmt: skip
            lives[name] = out["live_peak"]
            del out
            release(device)
        text += _compare(shape, reports, lives)
        if shape is shapes[0]:
            for name in ("bf16 eager", "fp8 eager"):
                table = reports[name].format(f"{name}, {shape.layers} layer(s): what each saves")
                print(table, flush=True)
                text += table
        results.append(row)
    sharding = memory_shard.run(device, quick=quick)  # bytes per parameter, sharded or not
    text += sharding["table"]
    return {"env": environment(device), "results": results, "sharding": sharding, "table": text}


def _compare(shape: Shape, reports: dict, lives: dict) -> str:
    """Categories in rows, modes in columns, MiB; CUDA counters (or the CPU's LiveBytes peak of
    the last microbatch) below."""
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
    if any(v is not None for v in lives.values()):
        peaks = [lives[n] / MiB if lives[n] is not None else "-" for n in names]
        rows.append(["CPU: peak live bytes of the last microbatch", *peaks])
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
        for name, mode in MODES.items():
            row["modes"][name] = _subprocess(shape, mode, device)
        results.append(row)
    text = _table_text(results)
    return {"env": environment(device), "results": results, "table": text}


def _subprocess(shape: Shape, mode: dict, device) -> dict:
    args = dict(vars(shape), **mode, device=str(device))
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.memory_run", json.dumps(args)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table_text(results) -> str:
    names = list(MODES)
    rows, ratios = [], []
    for r in results:
        modes, hidden = r["modes"], r["shape"]["hidden"]
        rows.append([hidden, *[_cell(modes[n]) for n in names]])
        reserved = {n: (modes[n].get("after_steps") or {}).get("reserved") for n in names}
        if all(reserved.values()):
            ratio = reserved["fp8 graphed"] / reserved["bf16 graphed"]
            lean = reserved["fp8 graphed, w.T in bwd"] / reserved["bf16 graphed"]
            target = TARGETS.get(hidden)
            verdict = "-" if target is None else "met" if ratio <= target else "missed"
            eager = reserved["fp8 eager"] / reserved["bf16 eager"]
            fp8w = reserved["fp8 graphed, FP8 weights"] / reserved["bf16 graphed"]
            ratios.append([hidden, ratio, lean, target or "-", verdict, eager, fp8w])
    s = results[0]["shape"]
    text = print_table(
        f"memory_reserved after 2 steps of 4 microbatches, GiB (peak allocated); one process "
        f"per mode; {s['layers']} TransformerLayers, batch {s['batch']} x seq {s['seq']}",
        ["hidden", *names],
        rows,
    )
    if ratios:
        header = ["hidden", "fp8 graphed / bf16 graphed", "w.T in bwd / bf16 graphed",
                  "target", "", "fp8 eager / bf16 eager", "FP8 weights / bf16 graphed"]  # fmt: skip
        text += print_table("FP8 / bf16 reserved", header, ratios)
    return text


def _cell(mode: dict) -> str:
    after = mode.get("after_steps")
    if not after:
        return mode.get("error", "-")
    return f"{after['reserved'] / GiB:.2f} ({after['max_allocated'] / GiB:.2f})"
