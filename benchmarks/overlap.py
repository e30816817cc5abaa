"""How much of a profiled step the collectives take, and whether they overlap compute: the GPU
kernels of a trace split into NCCL kernels and the rest, each set's busy time (overlapping kernels
counted once), the time both run at once, and where in the step the NCCL kernels sit."""

from __future__ import annotations

import re

from graphfp8.training.trace_stats import busy_length, busy_union

__all__ = ["busy_union", "collective_summary", "nccl_kind", "overlap_length"]

_NCCL = re.compile(r"nccl", re.IGNORECASE)
_KINDS = ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv", "Reduce")


def nccl_kind(name: str) -> str | None:
    """The collective of a NCCL kernel's name ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL"
    -> "ReduceScatter"), "other" for another NCCL kernel, None for a compute kernel."""
    if not _NCCL.search(name):
        return None
    return next((k for k in _KINDS if k.lower() in name.lower()), "other")


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both of two merged (busy_union) interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def collective_summary(kernels: list[tuple[str, float, float]]) -> dict:
    """NCCL kernels against compute kernels of one profiled span.

    Args:
        kernels: (name, start, end) of every GPU kernel (one device), microseconds.

    Returns:
        {"span_us" (first start to last end), "compute_busy_us", "nccl_busy_us", "nccl_share"
        (of the span), "overlap_us" (NCCL and compute at once), "nccl_overlapped" (share of the
        NCCL time with compute beside it), "nccl_exposed_us" (NCCL alone), "nccl_window"
        ([first NCCL start, last NCCL end] as fractions of the span), "by_kind" {kind:
        {"kernels", "us"}}}; the NCCL entries 0 / None without NCCL kernels.
    """
    if not kernels:
        return {"span_us": 0.0, "nccl_busy_us": 0.0, "by_kind": {}}
    t0 = min(s for _, s, _ in kernels)
    span = max(e for _, _, e in kernels) - t0
    tagged = [(n, s, e, nccl_kind(n)) for n, s, e in kernels]
    nccl = [k for k in tagged if k[3] is not None]
    compute = busy_union([(s, e) for _, s, e, kind in tagged if kind is None])
    comm = busy_union([(s, e) for _, s, e, _ in nccl])
    comm_us, both = busy_length(comm), overlap_length(comm, compute)
    by_kind: dict[str, dict] = {}
    for _, s, e, kind in nccl:
        entry = by_kind.setdefault(kind, {"kernels": 0, "us": 0.0})
        entry["kernels"] += 1
        entry["us"] += e - s
    window = None
    if comm:
        window = [round((comm[0][0] - t0) / span, 4), round((comm[-1][1] - t0) / span, 4)]
    return {"span_us": span, "compute_busy_us": busy_length(compute), "nccl_busy_us": comm_us,
            "nccl_share": comm_us / span if span else 0.0, "overlap_us": both,
            "nccl_overlapped": both / comm_us if comm_us else None,
            "nccl_exposed_us": comm_us - both, "nccl_window": window,
            "by_kind": by_kind}  # fmt: skip
