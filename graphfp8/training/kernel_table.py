"""Every GPU kernel of a profiled training step attributed to one category - GEMM, attention,
FP8 casts, norms, RoPE, loss, optimizer, inductor's fused kernels, other ATen kernels,
memcpy / memset, and "other" for the rest - so the table has no unattributed remainder, and the
GPU busy time as the union of the kernels' intervals (docs/benchmarking.md, "The floor")."""

from __future__ import annotations

from collections import defaultdict

from graphfp8.training.trace_stats import busy_length, busy_union

__all__ = ["CATEGORIES", "category", "kernel_table"]

# (category, substrings of a lower-cased kernel name), tried in order; the first match wins.
CATEGORIES = (
    ("memcpy/memset", ("memcpy", "memset")),
    ("attention", ("sdpa", "fmha", "flash", "attention", "attn")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "foreach", "lpnorm")),
    ("rope", ("rope",)),
    ("loss", ("cross_entropy", "softmax", "nll")),
    ("fp8 cast", ("cast", "amax", "quantize", "scale_update", "fp8", "glu", "dbias", "transpose")),
    ("norm", ("norm", "param_grad")),
    ("inductor (triton)", ("triton",)),
    (
        "aten elementwise/reduce",
        (
            "elementwise",
            "reduce",
            "vectorized",
            "unrolled",
            "index",
            "embedding",
            "cat",
            "copy",
            "fill",
        ),
    ),  # fmt: skip
)
OTHER = "other"


def category(name: str) -> str:
    """The category of a kernel name (OTHER when no rule matches)."""
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), OTHER)


def kernel_table(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """The kernels of `steps` profiled steps, per step.

    Args:
        kernels: (name, start us, end us) of every kernel, memcpy and memset.
        steps: the optimizer steps they ran.

    Returns:
        {"categories": {category: {"launches", "ms", "share"}} (every category, "other"
        included; the shares of kernel time sum to 1), "kernel_ms" (summed kernel time),
        "busy_ms" (the union of the kernels' intervals: overlapping kernels count once),
        "kernels": [{"name", "category", "launches", "us"}] every kernel name, by time}.
    """
    launches: dict[str, int] = defaultdict(int)
    times: dict[str, float] = defaultdict(float)
    for name, start, end in kernels:
        launches[name] += 1
        times[name] += end - start
    total_us = sum(times.values())
    cats = {c: {"launches": 0.0, "ms": 0.0, "share": 0.0} for c, _ in CATEGORIES}
    cats[OTHER] = {"launches": 0.0, "ms": 0.0, "share": 0.0}
    rows = []
    for name in sorted(times, key=times.get, reverse=True):
        cat = category(name)
        cats[cat]["launches"] += launches[name] / steps
        cats[cat]["ms"] += times[name] / steps / 1e3
        rows.append({"name": name, "category": cat, "launches": launches[name] / steps,
                     "us": times[name] / steps})  # fmt: skip
    for row in cats.values():
        row["share"] = row["ms"] * steps * 1e3 / total_us if total_us else 0.0
    busy = busy_length(busy_union([(s, e) for _, s, e in kernels])) if kernels else 0.0
    return {"categories": cats, "kernel_ms": total_us / steps / 1e3,
            "busy_ms": busy / steps / 1e3, "kernels": rows}  # fmt: skip
