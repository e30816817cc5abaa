"""Numbers for the profile summary: GPU busy fraction, top kernels, and nsys report parsing."""

from __future__ import annotations

import csv
import subprocess
from collections import defaultdict
from pathlib import Path

__all__ = ["busy_fraction", "busy_length", "busy_union", "kernel_events", "nsys_summary",
           "parse_gpu_trace", "top_kernels"]  # fmt: skip


def busy_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals merged: sorted, disjoint (start, end) pairs covering the same time."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy_length(merged: list[tuple[float, float]]) -> float:
    """The time a busy_union covers."""
    return sum(e - s for s, e in merged)


def busy_fraction(intervals: list[tuple[float, float]]) -> float:
    """Share of the span from the first kernel start to the last kernel end during which at least
    one kernel ran (overlapping kernels count once).

    Args:
        intervals: (start, end) of every kernel, any time unit.
    """
    if not intervals:
        return 0.0
    merged = busy_union(intervals)
    total = merged[-1][1] - merged[0][0]
    return busy_length(merged) / total if total > 0 else 1.0


def kernel_events(prof) -> list:
    """The GPU kernels (and memcpy / memset) of a torch.profiler run: its CUDA events without
    the GPU-side copies of NVTX / record_function ranges, which are annotations."""
    import torch

    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith("graphfp8::")
            and not getattr(e, "is_user_annotation", False)]  # fmt: skip


def top_kernels(samples: list[tuple[str, float]], n: int = 15) -> list[dict]:
    """The n kernels (or ops) with the most total time.

    Args:
        samples: (name, microseconds) per launch.

    Returns:
        [{"name", "calls", "us", "share"}] sorted by total time.
    """
    calls: dict[str, int] = defaultdict(int)
    times: dict[str, float] = defaultdict(float)
    for name, us in samples:
        calls[name] += 1
        times[name] += us
    total = sum(times.values()) or 1.0
    ranked = sorted(times, key=times.get, reverse=True)[:n]
    return [{"name": k, "calls": calls[k], "us": times[k], "share": times[k] / total}
            for k in ranked]  # fmt: skip


def parse_gpu_trace(csv_path: Path) -> list[tuple[str, float, float]]:
    """Rows of nsys's cuda_gpu_trace report: (name, start ns, end ns) for kernels only."""
    rows = []
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        cols = reader.fieldnames or []
        start = next(c for c in cols if c.startswith("Start"))
        dur = next(c for c in cols if c.startswith("Duration"))
        name = next(c for c in cols if c == "Name")
        for row in reader:
            if row[name].startswith("[CUDA "):  # memcpy / memset rows
                continue
            s = float(row[start])
            rows.append((row[name], s, s + float(row[dur])))
    return rows


def nsys_summary(report: Path, microbatches: int) -> dict:
    """Kernels per microbatch, busy fraction and top kernels of an nsys report."""
    prefix = report.with_suffix("")
    subprocess.run(["nsys", "stats", "--report", "cuda_gpu_trace", "--format", "csv",
                    "--force-export=true", "--force-overwrite=true", "-o", str(prefix),
                    str(report)], check=True)  # fmt: skip
    kernels = parse_gpu_trace(Path(f"{prefix}_cuda_gpu_trace.csv"))
    return {"tool": "nsys", "trace": str(report),
            "kernels_per_microbatch": len(kernels) / microbatches,
            "busy_fraction": busy_fraction([(s, e) for _, s, e in kernels]),
            "top": top_kernels([(n, (e - s) / 1e3) for n, s, e in kernels])}  # fmt: skip
