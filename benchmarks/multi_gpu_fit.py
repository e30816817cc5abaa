"""The largest model that trains on N GPUs sharded with FP8 primary weights (`--ddp --shard
--fp8-weights --graphs step`, issue 34 item 4): GPT shapes from 1B to 64B parameters (graphfp8-
train's blocks, head_dim 128, ffn 4h, the 100m preset's batch 8 x 1024), each predicted from a
measured run of benchmarks/multi_gpu.py at the same N - the state's bytes per parameter times the
parameters, plus the rest of that run's peak (activations, graph pool, buffers) scaled by layers
x hidden - against the GPU's memory; then it trains the largest predicted to fit for 2 steps
(`torchrun -m benchmarks.multi_gpu --presets NAME`, a fresh process each), stepping down while
they fail or once up after a success, within a time budget.

    python -m benchmarks.multi_gpu_fit speed_N.json --nproc N --out DIR   (writes DIR/fit.json)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from graphfp8.training.model import PRESETS, ModelConfig
from graphfp8.training.torch_model import TorchGPT

__all__ = ["FIT_SHAPES", "parameters", "predict", "search"]

HEADROOM = 0.92  # of the GPU's memory: allocator fragmentation and NCCL's own buffers


def _shape(hidden: int, layers: int) -> ModelConfig:
    return replace(PRESETS["100m"], hidden=hidden, heads=hidden // 128, ffn=4 * hidden,
                   layers=layers, lr=1e-4)  # fmt: skip


FIT_SHAPES = {
    "1b": _shape(2048, 20),
    "2b": _shape(2560, 26),
    "4b": _shape(3072, 36),
    "7b": _shape(4096, 32),
    "13b": _shape(5120, 40),
    "20b": _shape(6144, 44),
    "34b": _shape(7168, 56),
    "64b": _shape(8192, 80),
}


def parameters(cfg: ModelConfig) -> int:
    """The GPT's parameter count (its torch twin built on the meta device)."""
    return sum(p.numel() for p in TorchGPT(cfg, device="meta").parameters())


def _reference(speed: dict) -> dict:
    """The measured sharded FP8-weights step-graph run with the most parameters."""
    runs = [r for r in speed["runs"] if r.get("config") == "shard-fp8w" and r.get("mode") == "step"
            and "error" not in r]  # fmt: skip
    if not runs:
        raise ValueError("no shard-fp8w:step run without an error to predict from")
    return max(runs, key=lambda r: r["parameters"])


def predict(speed: dict, capacity_bytes: int) -> list[dict]:
    """Every FIT_SHAPES entry's predicted peak per GPU at the world size of `speed` (a
    benchmarks/multi_gpu.py JSON with a shard-fp8w:step run).

    Returns:
        [{"name", "parameters", "predicted_bytes", "fits"}] from the smallest.
    """
    ref = _reference(speed)
    cfg = PRESETS[ref["preset"]]
    per_param = max(m["state_bytes_per_parameter"]["total"] for m in ref["memory_per_rank"])
    peak = max(m["max_allocated_bytes"] for m in ref["memory_per_rank"])
    rest = max(0.0, peak - per_param * ref["parameters"])
    per_layer_width = rest / (cfg.layers * cfg.hidden)
    out = []
    for name, shape in FIT_SHAPES.items():
        n = parameters(shape)
        predicted = per_param * n + per_layer_width * shape.layers * shape.hidden
        out.append({"name": name, "parameters": n, "predicted_bytes": int(predicted),
                    "fits": predicted <= HEADROOM * capacity_bytes})  # fmt: skip
    return out


def search(names: list[str], start: int, attempt, deadline: float) -> list[tuple[str, bool]]:
    """Tries names[start], then smaller ones while they fail, or once the next larger one after a
    success; stops at `deadline` (time.monotonic()).

    Args:
        names: candidates from the smallest.
        start: the index of the largest predicted to fit (-1: none predicted; the smallest is
            tried).
        attempt: name -> whether it trained.

    Returns:
        [(name, trained)] in the order tried.
    """
    tried: list[tuple[str, bool]] = []
    i = max(start, 0)
    while 0 <= i < len(names) and time.monotonic() < deadline:
        ok = attempt(names[i])
        tried.append((names[i], ok))
        if ok:
            if len(tried) > 1 and not tried[-2][1]:
                break  # the one above failed: this is the largest
            i += 1
            if len(tried) > 1:  # a second success upward: no more probing
                break
        else:
            if any(t[1] for t in tried):
                break  # a success below: that one is the largest
            i -= 1
    return tried


def _attempt(name: str, args, out: Path) -> bool:
    """Trains `name` (2 steps, sharded FP8 weights, the step graph) under torchrun in a fresh
    process group: a failed capture cannot leave state behind for the next attempt."""
    path = out / f"fit_{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "-m", "benchmarks.multi_gpu", "--presets", name,
           "--configs", "shard-fp8w", "--modes", "step", "--steps", "2", "--microbatches",
           str(args.microbatches), "--json", str(path)]  # fmt: skip
    with open(out / f"fit_{name}.log", "w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.attempt_s)
        except subprocess.TimeoutExpired:
            return False
    try:
        (run,) = json.loads(path.read_text())["runs"]
    except (OSError, ValueError):
        return False
    return "error" not in run


def _gpu_memory() -> int:
    """GPU 0's memory in bytes, from nvidia-smi: a CUDA context in this process would take GPU
    memory from the attempts' rank 0 for as long as they run."""
    try:
        query = [
            "nvidia-smi",
            "--query-gpu=memory.total",
            "--format=csv,noheader,nounits",
            "-i",
            "0",
        ]
        out = subprocess.run(query, capture_output=True, text=True, check=True)
        return int(out.stdout.split()[0]) * 2**20
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return torch.cuda.get_device_properties(0).total_memory


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multi_gpu_fit")
    p.add_argument("speed", help="a benchmarks/multi_gpu.py JSON with a shard-fp8w:step run")
    p.add_argument("--nproc", type=int, required=True, help="GPUs (torchrun's processes)")
    p.add_argument("--out", type=Path, required=True, help="folder for fit.json and the runs")
    p.add_argument("--capacity-gib", type=float, help="default: this GPU's total memory")
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--budget-s", type=float, default=150.0, help="no attempt starts after it")
    p.add_argument("--attempt-s", type=float, default=90.0, help="one attempt's limit")
    args = p.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    speed = json.loads(Path(args.speed).read_text())
    capacity = int(args.capacity_gib * 2**30) if args.capacity_gib else _gpu_memory()
    rows = predict(speed, capacity)
    names = [r["name"] for r in rows]
    start = max((i for i, r in enumerate(rows) if r["fits"]), default=-1)
    args.out.mkdir(parents=True, exist_ok=True)
    head = {"world": args.nproc, "capacity_bytes": capacity, "headroom": HEADROOM,
            "microbatches": args.microbatches, "predictions": rows}  # fmt: skip
    done: list[tuple[str, bool]] = []

    def attempt(name: str) -> bool:  # fit.json rewritten after each: a timeout keeps them
        done.append((name, _attempt(name, args, args.out)))
        _write_result(args.out, head, done, names)
        return done[-1][1]

    _write_result(args.out, head, done, names)
    tried = search(names, start, attempt, deadline)
    print(f"fit at N={args.nproc}: tried {tried}; largest that trains: "
          f"{_largest(tried, names)[0]}")  # fmt: skip
    return 0


def _largest(tried: list[tuple[str, bool]], names: list[str]) -> tuple[str | None, str | None]:
    """(the largest that trained, the smallest larger one that failed), None where none."""
    fitting = [n for n, ok in tried if ok]
    largest = max(fitting, key=names.index) if fitting else None
    above = sorted((n for n, ok in tried if not ok and largest
                    and names.index(n) > names.index(largest)), key=names.index)  # fmt: skip
    return largest, above[0] if above else None


def _write_result(out: Path, head: dict, tried: list, names: list[str]) -> None:
    largest, above = _largest(tried, names)
    result = {**head, "tried": tried, "largest_fitting": largest, "next_larger_fails": above}
    (out / "fit.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
