"""`make profile`: a few graphed training steps under nsys (when on PATH) or torch.profiler, and
a summary of where the time goes, written into profiles/<device>-<date>/."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from graphfp8.nvtx_ranges import enable_ranges
from graphfp8.training.cli_checks import model_config
from graphfp8.training.data import Dataset
from graphfp8.training.kernel_table import kernel_table
from graphfp8.training.loop import sync
from graphfp8.training.model import PRESETS
from graphfp8.training.run import GRAPH_MODES, PRECISIONS, Run, RunSpec
from graphfp8.training.sources import DataError, open_stream
from graphfp8.training.trace_stats import (
    busy_fraction,
    kernel_events,
    nsys_summary,
    top_kernels,
)

__all__ = ["main", "profile_steps", "trace_name"]


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m graphfp8.training.step_profile")
    cuda = torch.cuda.is_available()
    p.add_argument("--preset", choices=sorted(PRESETS), default="100m" if cuda else "tiny")
    p.add_argument("--precision", choices=PRECISIONS, default="fp8")
    p.add_argument(
        "--graphs",
        nargs="?",
        const="layers",
        default="layers",
        choices=GRAPH_MODES,
        help="layers (default), step (the whole step as one graph) or none",
    )
    p.add_argument("--no-graphs", dest="graphs", action="store_const", const="none")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, help="sequences per microbatch (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--heads", type=int, help="attention heads (default: the preset's)")
    p.add_argument("--fp8-attention", action="store_true", help="as graphfp8-train's")
    p.add_argument("--steps", type=int, default=3, help="profiled optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps before profiling")
    p.add_argument("--tool", choices=("auto", "nsys", "torch"), default="auto")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    # Synthetic by default: a profile is about the kernels, which the text does not change, and
    # the generated corpus is in memory, so no file read lands in the host time measured.
    p.add_argument("--data", default="synthetic", help="as graphfp8-train's --data")
    p.add_argument("--vocab-size", type=int, help="as graphfp8-train's --vocab-size")
    p.add_argument("--out", type=Path, help="default profiles/<device>-<date>")
    args = p.parse_args(argv)
    for name in ("microbatches", "steps", "warmup_steps", "batch", "seq_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tool == "auto":
        args.tool = "nsys" if shutil.which("nsys") and args.device.startswith("cuda") else "torch"
    if args.out is None:
        tag = "cpu"
        if args.device.startswith("cuda"):
            tag = torch.cuda.get_device_name(torch.device(args.device)).split()[-1].lower()
        args.out = Path("profiles") / f"{tag}-{datetime.now(timezone.utc):%Y-%m-%d}"
    return args


def _host_times(run: Run, steps: int, total: int) -> tuple[float, float]:
    """(host enqueue ms, wall ms) per microbatch, median over `steps` unprofiled steps."""
    host, wall = [], []
    for _ in range(steps):
        sync(run.spec.device)
        t0 = time.perf_counter()
        run.train_step(total)
        t1 = time.perf_counter()
        sync(run.spec.device)
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    mbs = run.spec.microbatches
    return statistics.median(host) / mbs, statistics.median(wall) / mbs


def _is_top_level_op(event) -> bool:
    """An aten op that no other aten op called (what the caller, or a tape, dispatched)."""
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def profile_steps(run: Run, steps: int, total: int):
    """`steps` training steps of `run` (of `total` in its schedule) under torch.profiler, host
    and (on a GPU) device activity. Returns the profiler (kernel_events, export_chrome_trace)."""
    from torch.profiler import ProfilerActivity, profile

    device = run.spec.device
    activities = [ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run.train_step(total)
        sync(device)
    return prof


def trace_name(run: Run) -> str:
    return f"trace_{run.spec.preset}_{run.spec.name}.json"


def _torch_profile(run: Run, args, total: int) -> dict:
    prof = profile_steps(run, args.steps, total)
    trace = args.out / trace_name(run)
    prof.export_chrome_trace(str(trace))
    events = kernel_events(prof)
    microbatches = args.steps * args.microbatches
    if not events:  # CPU: operators instead of kernels
        ops = [e for e in prof.events() if _is_top_level_op(e)]
        return {"tool": "torch.profiler", "trace": str(trace), "kernels_per_microbatch": None,
                "top_level_ops_per_microbatch": len(ops) / microbatches,
                "busy_fraction": None,
                "top": top_kernels([(e.name, e.self_cpu_time_total) for e in ops])}  # fmt: skip
    intervals = [(e.time_range.start, e.time_range.end) for e in events]
    memops = sum(e.name.startswith(("Memset", "Memcpy")) for e in events)
    table = kernel_table([(e.name, *span) for e, span in zip(events, intervals, strict=True)],
                         microbatches)  # fmt: skip
    return {"tool": "torch.profiler", "trace": str(trace),
            "kernels_per_microbatch": (len(events) - memops) / microbatches,
            "memcpy_memset_per_microbatch": memops / microbatches,
            "busy_fraction": busy_fraction(intervals), "kernel_table": table,
            "top": top_kernels([(e.name, e.device_time) for e in events])}  # fmt: skip


def _nsys_profile(args, argv) -> dict:
    """Re-runs this command under nsys (profiling only the marked steps), then reads its stats."""
    report = args.out / "nsys_report"
    cmd = ["nsys", "profile", "-t", "cuda,nvtx", "--cuda-graph-trace=node", "--force-overwrite",
           "true", "--capture-range=cudaProfilerApi", "-o", str(report), sys.executable, "-m",
           "graphfp8.training.step_profile", *argv, "--tool", "torch",
           "--out", str(args.out)]  # fmt: skip
    env = dict(os.environ, GRAPHFP8_UNDER_NSYS="1")
    subprocess.run(cmd, check=True, env=env)
    return nsys_summary(report.with_suffix(".nsys-rep"), args.steps * args.microbatches)


def _markdown(summary: dict) -> str:
    p = summary["profile"]
    lines = [
        f"# make profile: {summary['run']} ({summary['preset']}), {summary['date']}",
        "",
        f"- device: {summary['device']}; torch {summary['torch']}; tool: {p['tool']}",
        f"- microbatches profiled: {summary['microbatches_profiled']}",
        f"- host enqueue time per microbatch: {summary['host_ms_per_microbatch']:.3f} ms; "
        f"wall time per microbatch (synchronised): {summary['wall_ms_per_microbatch']:.3f} ms",
    ]
    if p.get("kernels_per_microbatch") is not None:
        memops = p.get("memcpy_memset_per_microbatch")
        extra = f" (+ {memops:.1f} memcpy/memset)" if memops is not None else ""
        lines.append(f"- kernels per microbatch: {p['kernels_per_microbatch']:.1f}{extra}")
        lines.append(f"- GPU busy fraction during the profiled steps: {p['busy_fraction']:.3f}")
        lines += _busy_lines(summary)
    else:
        lines.append(f"- top-level operators per microbatch (CPU): "
                     f"{p['top_level_ops_per_microbatch']:.1f}; no GPU")  # fmt: skip
    lines += ["", "| kernel | calls | total us | share |", "| --- | --- | --- | --- |"]
    lines += [f"| {k['name'][:90]} | {k['calls']} | {k['us']:.1f} | {k['share']:.3f} |"
              for k in p["top"]]  # fmt: skip
    return "\n".join(lines) + "\n"


def _busy_lines(summary: dict) -> list[str]:
    """GPU busy over the unprofiled wall and the kernel time by category (docs/benchmarking.md,
    "The floor"), when the profile has a kernel table (torch.profiler on a GPU)."""
    table = summary["profile"].get("kernel_table")
    if table is None:
        return []
    wall = summary["wall_ms_per_microbatch"]
    lines = [
        f"- GPU busy over the unprofiled wall: {table['busy_ms'] / wall:.3f} (kernel union "
        f"{table['busy_ms']:.3f} ms per microbatch / wall {wall:.3f} ms)",
        "",
        "| category | ms per microbatch | launches | share |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {name} | {c['ms']:.3f} | {c['launches']:.1f} | {c['share']:.3f} |"
              for name, c in table["categories"].items()]  # fmt: skip
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    try:
        data = Dataset(open_stream(args.data, args.vocab_size), val_fraction=0.0)
        cfg = model_config(args, data.vocab_size)
        data.check_seq_len(cfg.seq_len)
    except DataError as exc:
        print(f"python -m graphfp8.training.step_profile: error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    enable_ranges(True)
    spec = RunSpec(
        preset=args.preset,
        model=cfg,
        precision=args.precision,
        graphs=args.graphs,
        microbatches=args.microbatches,
        device=args.device,
        fp8_attention=args.fp8_attention and args.precision == "fp8",
    )
    run = Run(spec, data)
    run.prepare()
    total = args.warmup_steps + 2 * args.steps
    for _ in range(args.warmup_steps):
        run.train_step(total)
    host_ms, wall_ms = _host_times(run, args.steps, total)
    if args.tool == "nsys":
        profile = _nsys_profile(args, argv)
    elif os.environ.get("GRAPHFP8_UNDER_NSYS") == "1":  # the child nsys runs: mark the steps
        sync(args.device)
        torch.cuda.cudart().cudaProfilerStart()
        for _ in range(args.steps):
            run.train_step(total)
        sync(args.device)
        torch.cuda.cudart().cudaProfilerStop()
        return 0
    else:
        profile = _torch_profile(run, args, total)
    summary = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}", "run": spec.name,
               "preset": args.preset, "device": _device_name(args.device),
               "torch": torch.__version__, "microbatches_profiled": args.steps * args.microbatches,
               "host_ms_per_microbatch": host_ms, "wall_ms_per_microbatch": wall_ms,
               "profile": profile}  # fmt: skip
    stem = args.out / f"profile_{args.preset}_{spec.name}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(summary))
    print(_markdown(summary))
    print(f"wrote {stem}.md and .json")
    return 0


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


if __name__ == "__main__":
    raise SystemExit(main())
