"""Per-kernel GPU time and kernel counts of a callable, read from torch.profiler."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["kernel_stats"]


def kernel_stats(fn: Callable[[], object], iters: int = 20) -> dict[str, tuple[int, float]]:
    """Runs fn `iters` times under the profiler (after one warm-up call).

    Returns:
        {kernel name: (launches per call, GPU microseconds per call)} for every CUDA kernel and
        memset/memcpy the calls ran.
    """
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    stats: dict[str, tuple[int, float]] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        count, total = stats.get(evt.name, (0, 0.0))
        stats[evt.name] = (count + 1, total + evt.device_time)
    return {name: (count / iters, total / iters) for name, (count, total) in stats.items()}
