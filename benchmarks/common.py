"""Benchmark plumbing: device timing (CUDA events or host clock), tables, JSON with metadata."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from graphfp8.training.floor import cuda_ms

__all__ = ["time_device", "time_host", "gpu_busy", "sync", "environment", "print_table",
           "write_json", "graph_of", "env_var"]  # fmt: skip


def sync(device) -> None:
    """Waits for `device`'s queued work (a torch.device or its name; a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_device(fn: Callable[[], object], device, *, warmup=3, iters=20, repeats=5) -> float:
    """Median over `repeats` of the mean time of one call, in ms, over `iters` back-to-back
    calls (CUDA events on a GPU, the host clock after a sync on the CPU)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            samples.append(cuda_ms(fn, iters) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def time_host(fn: Callable[[], object], device, *, warmup=3, iters=20, repeats=5) -> float:
    """Median over `repeats` of the mean host (CPU) time to enqueue one call, in ms: the device
    is synchronised before each call and the clock runs only while fn enqueues. Timing calls
    back to back would measure back-pressure instead: once the launch queue is full, an enqueue
    waits for the GPU, so a step that enqueues more than the GPU runs in its time looks as
    slow as the GPU (docs/benchmarking.md)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(iters):
            sync(device)
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        samples.append(total * 1e3 / iters)
    sync(device)
    return statistics.median(samples)


def gpu_busy(fn: Callable[[int], object], calls: int, device) -> dict:
    """`calls` calls of fn(i) under torch.profiler: CUDA kernels (and memcpy/memset) per call
    and the GPU busy fraction over them (training/trace_stats.py's; None on the CPU, which has
    no kernels). Busy well below 1 says the work waits on the host. On a GPU only the CUDA
    activity is traced: host op events would cost more than the calls on long Python-bound loops
    (a 128-token HF generate() took minutes to summarise with them).

    Returns:
        {"calls", "kernels_per_call", "busy_fraction"}.
    """
    from torch.profiler import ProfilerActivity, profile

    from graphfp8.training.trace_stats import busy_fraction, kernel_events

    device = torch.device(device)
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    sync(device)
    with profile(activities=[activity]) as prof:
        for i in range(calls):
            fn(i)
        sync(device)
    kernels = [(e.time_range.start, e.time_range.end) for e in kernel_events(prof)]
    return {"calls": calls, "kernels_per_call": len(kernels) / calls,
            "busy_fraction": busy_fraction(kernels) if kernels else None}  # fmt: skip


def graph_of(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """Captures `calls` back-to-back calls of fn into one CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def environment(device) -> dict:
    """Date, machine, GPU and library versions, for the JSON and the committed tables."""
    device = torch.device(device)
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except ImportError:
        env["torchao"] = None
    return env


@contextlib.contextmanager
def env_var(name: str, value: str):
    """os.environ[name] = value inside the block, as it was after (for switches read at capture,
    graphfp8.ops.switches.ENV_DEFAULTS: one process captures both sides of an A/B)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def print_table(title: str, header: list[str], rows: list[list]) -> str:
    """Prints and returns a Markdown table."""
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" for _ in header) + " |")
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
