"""Where a speed row's step exceeds its physical floor, kernel family by kernel family (issue 41):
each profiled kernel of `benchmarks speed`'s kernel table in one group, beside the part of the
floor (graphfp8/training/floor.py, memory_parts) that group's work costs at the row's ceilings.

    python -m benchmarks.floor_gap [SPEED_JSON] [--peers fp8-graphs,bf16-torch-compile]

Excess = measured - floor per group; the groups' excesses plus the idle time (unprofiled wall
minus the kernel sum: negative where the profiler slowed the kernels, docs/benchmarking.md,
"The floor") add up to wall - floor.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import print_table
from graphfp8.training.floor import Ceilings, floor, memory_parts
from graphfp8.training.presets import ModelConfig

__all__ = ["GROUPS", "gap_rows", "gap_table", "group_of"]

KEPT = "profiles/h200-2026-12-01-s6/bench_speed41.json"
PEERS = ("fp8-graphs", "bf16-torch-compile")

# (group, the floor parts it is measured against): memory_parts' keys, or "gemm" / "attention"
GROUPS = {
    "GEMMs": ("gemm",),
    "attention (cuDNN)": ("attention",),
    "activation fwd (SwiGLU)": ("act_fwd",),
    "activation bwd": ("act_bwd",),
    "norm fwd (+ residual add, FP8 transpose pass)": ("norm_fwd",),
    "norm bwd (+ parameter grads)": ("norm_bwd",),
    "casts / cast-transposes": ("casts", "weight_casts"),
    "RoPE fwd + bwd": ("rope_fwd", "rope_bwd"),
    "grad accumulation (-0.0 fill, adds)": (),
    "optimizer (AdamW, clip)": ("optimizer",),
    "head, loss, embedding": ("loss",),
    "memset / memcpy": (),
    "other": (),
}


def group_of(name: str, category: str) -> str:
    """The group of one kernel of a kernel table (its name and kernel_table category)."""
    n = name.lower()
    if category == "gemm":
        return "GEMMs"
    if category == "attention" or "cudnn" in n:
        return "attention (cuDNN)"
    if any(s in n for s in ("nll_loss", "softmax", "embedding", "radix", "cub::", "gather",
                            "compute_grad_weight", "sum_and_scatter", "segment")):  # fmt: skip
        return "head, loss, embedding"
    if any(s in n for s in ("glu_bwd", "silu_backward", "gelu_backward")):
        return "activation bwd"
    if "glu_fwd" in n or "silu" in n:
        return "activation fwd (SwiGLU)"
    if any(s in n for s in ("norm_bwd", "param_grad", "norm_backward", "norm_grad", "gammabeta")):
        return "norm bwd (+ parameter grads)"
    if "norm" in n and "lpnorm" not in n or "fp8_transpose" in n:
        return "norm fwd (+ residual add, FP8 transpose pass)"
    if "rope" in n or "triton" in n and "cat" in n and ("neg" in n or "sub" in n):
        return "RoPE fwd + bwd"
    if any(s in n for s in ("functor_add<c10::bfloat16>", "zerofunctor", "std::negate",
                            "binaryoplistalphafunctor", "grad_fold",
                            "fillfunctor<c10::bfloat16>")):  # fmt: skip
        return "grad accumulation (-0.0 fill, adds)"
    if category == "optimizer":
        return "optimizer (AdamW, clip)"
    if any(s in n for s in ("cast", "amax", "copy", "transpose")):
        return "casts / cast-transposes"
    if category == "memcpy/memset":
        return "memset / memcpy"
    return "other"


def gap_rows(row: dict, peer: str) -> list[dict]:
    """One speed row's peer by group: {"group", "launches", "ms", "floor_ms", "excess_ms",
    "share"} per step, then "idle" and "total" (share: of wall - floor)."""
    p = row["peers"][peer]
    cfg = ModelConfig(**row["model"])
    precision = "fp8" if peer.startswith("fp8") else "bf16"
    ceilings = Ceilings(**row["ceilings"])
    tokens = row["tokens_per_step"]
    parts = {k: v / (ceilings.copy_tbps * 1e12) * 1e3
             for k, v in memory_parts(cfg, precision, tokens).items()}  # fmt: skip
    f = floor(cfg, precision, tokens, ceilings)
    parts["gemm"] = (f["blocks_gemm"] + f["head_gemm"]) * 1e3
    parts["attention"] = f["attention"] * 1e3
    measured = {g: [0.0, 0.0] for g in GROUPS}
    for k in p["kernel_table"]["kernels"]:
        m = measured[group_of(k["name"], k["category"])]
        m[0] += k["launches"]
        m[1] += k["us"] / 1e3
    wall, total_floor = p["ms_per_step"], f["total"] * 1e3
    gap = wall - total_floor
    rows = []
    for g, keys in GROUPS.items():
        fl = sum(parts[k] for k in keys)
        rows.append({"group": g, "launches": measured[g][0], "ms": measured[g][1],
                     "floor_ms": fl, "excess_ms": measured[g][1] - fl,
                     "share": (measured[g][1] - fl) / gap})  # fmt: skip
    idle = wall - p["kernel_table"]["kernel_ms"]
    rows.append({"group": "idle (wall - kernel sum)", "launches": 0.0, "ms": idle,
                 "floor_ms": 0.0, "excess_ms": idle, "share": idle / gap})  # fmt: skip
    rows.append({"group": "total (unprofiled wall)", "launches": sum(r["launches"] for r in rows),
                 "ms": wall, "floor_ms": total_floor, "excess_ms": gap, "share": 1.0})  # fmt: skip
    return rows


def gap_table(row: dict, peers=PEERS) -> str:
    """The groups of `peers` side by side: ms (launches), floor, excess and its share."""
    peers = [p for p in peers if row["peers"].get(p, {}).get("kernel_table")]
    if not peers:
        return ""
    by_peer = [gap_rows(row, p) for p in peers]
    header = ["group"]
    for p in peers:
        header += [f"{p} ms (launches)", "floor", "excess", "share of gap"]
    lines = []
    for i, r in enumerate(by_peer[0]):
        line = [r["group"]]
        for rows in by_peer:
            x = rows[i]
            line += [f"{x['ms']:.3f} ({x['launches']:.0f})", f"{x['floor_ms']:.3f}",
                     f"{x['excess_ms']:+.3f}", f"{x['share']:.3f}"]  # fmt: skip
        lines.append(line)
    m = row["model"]
    return print_table(
        f"{row['preset']} ({m['layers']} layers, B{m['batch']} x S{m['seq_len']}): ms per step "
        "by kernel group against the floor's part for that work (floor.memory_parts at the "
        "row's ceilings)",
        header,
        lines,
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default=KEPT)
    ap.add_argument("--peers", default=",".join(PEERS))
    args = ap.parse_args(argv)
    with open(args.path) as f:
        result = json.load(f)
    for row in result["rows"]:
        gap_table(row, args.peers.split(","))


if __name__ == "__main__":
    main()
