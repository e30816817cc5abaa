"""The summary of scripts/gpu_check.sh's `shard` step (issue 31, world size 1 with NCCL): whether
the sharded eager and step-graph runs of graphfp8-train trained the same losses bit for bit,
tokens/s of --shard against the unsharded run (target: within 3%), each run's memory per rank.
The eager-vs-step comparison shows bits on a GPU only with --deterministic: cuDNN's bf16
attention backward differs run to run there; its deterministic path gave the same bits run to
run on the H200 (2026-12-01, profiles/h200-2026-12-01-s4/det_summary.md).

    python scripts/shard_report.py RESULTS_DIR   (shard_modes/, shard_speed/, shard_speed--shard/)

Prints a few lines and one JSON line; exit status 1 when a run is missing or graphed != eager.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = 0.97  # --shard tokens/s at least 97% of unsharded


def _runs(folder: Path) -> list[dict]:
    return json.loads((folder / "summary.json").read_text())["runs"]


def _memory(run: dict) -> str:
    m = run["memory_per_rank"][0]
    per = m["state"]["bytes_per_parameter"]
    peak = m["max_allocated_bytes"]
    peak_text = f"{peak / 2**30:.2f} GiB" if peak is not None else "-"
    return f"{per['total']:.2f} B/param of state, max_allocated {peak_text}"


def main(results: str) -> int:
    res = Path(results)
    try:
        eager, graphed = _runs(res / "shard_modes")
        (plain,) = _runs(res / "shard_speed")
        (sharded,) = _runs(res / "shard_speed--shard")
    except (OSError, ValueError, KeyError) as exc:
        print(f"shard: a run is missing ({type(exc).__name__}: {exc})")
        return 1
    same = eager["losses"] == graphed["losses"]
    ratio = sharded["tokens_per_s"] / plain["tokens_per_s"]
    det = eager.get("deterministic") and graphed.get("deterministic")
    how = "--deterministic" if det else "not --deterministic: on a GPU this cannot show bits"
    print(
        f"shard: {eager['name']} vs {graphed['name']}, {len(eager['losses'])} steps: graphed "
        f"== eager bit for bit: {'yes' if same else 'NO'} ({how})"
    )
    verdict = "within" if ratio >= TARGET else "MISSED"
    print(
        f"shard: tokens/s {plain['name']} {plain['tokens_per_s']:,.0f}, {sharded['name']} "
        f"{sharded['tokens_per_s']:,.0f}: {ratio:.3f}x ({verdict} the 3% target)"
    )
    for run in (plain, sharded):
        print(f"shard: {run['name']}: {_memory(run)}")
    print(
        json.dumps(
            {
                "graphed_equals_eager": same,
                "tokens_per_s_ratio": ratio,
                "memory": {r["name"]: r["memory_per_rank"] for r in (plain, sharded)},
            }
        )
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
