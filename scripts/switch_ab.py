"""Off / on table of one kernel switch from graphfp8-train runs (gpu_check.sh's kern41 step).

Each directory holds one run's summary.json (one process per setting: the switches are read
when the extension loads), repeats interleaved off, on, off, on, ... so that drift of the
machine falls on both sides. Prints, per repeat, tokens/s off and on and their ratio, then the
median ratio with its min-max, and whether every run ended on the same final loss bit for bit
(the switch must change no result: with --deterministic the runs are comparable bit for bit).

    python scripts/switch_ab.py --switch NAME --off DIR [DIR ...] --on DIR [DIR ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def run_of(directory: str) -> dict:
    """The one run of a graphfp8-train summary.json: name, tokens/s, final loss."""
    runs = json.loads((Path(directory) / "summary.json").read_text())["runs"]
    if len(runs) != 1:
        raise SystemExit(f"{directory}: expected one run, found {len(runs)}")
    return runs[0]


def table(switch: str, off: list[dict], on: list[dict]) -> str:
    """The markdown table and its verdict lines."""
    if len(off) != len(on) or not off:
        raise SystemExit("switch_ab: give as many --on runs as --off runs (at least one)")
    head = "| repeat | off tok/s | on tok/s | on / off |\n| --- | --- | --- | --- |"
    lines = [f"### {switch}: {off[0]['name']} tokens/s, off / on, one process each", "", head]
    ratios = []
    for i, (a, b) in enumerate(zip(off, on, strict=True), 1):
        ratios.append(b["tokens_per_s"] / a["tokens_per_s"])
        lines.append(f"| {i} | {a['tokens_per_s']:,.0f} | {b['tokens_per_s']:,.0f} | "
                     f"{ratios[-1]:.4f} |")  # fmt: skip
    spread = f"(min {min(ratios):.4f}, max {max(ratios):.4f})"
    lines.append(f"\non / off median {statistics.median(ratios):.4f} {spread} "
                 f"over {len(ratios)} repeats")  # fmt: skip
    losses = {r["final_loss"] for r in off + on}
    same = "yes" if len(losses) == 1 else f"NO ({sorted(losses)})"
    lines.append(f"final loss the same bit for bit in every run: {same}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--switch", required=True)
    p.add_argument("--off", nargs="+", required=True)
    p.add_argument("--on", nargs="+", required=True)
    args = p.parse_args(argv)
    off, on = [run_of(d) for d in args.off], [run_of(d) for d in args.on]
    text = table(args.switch, off, on)
    print(text)
    return 0 if "NO (" not in text else 1


if __name__ == "__main__":
    raise SystemExit(main())
