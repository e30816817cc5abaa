"""Whether two graphfp8-train runs gave the same bits: compares the per-step training losses and
the validation losses of every run in two summary.json files (as floats parsed from JSON, which
round-trips float32 values exactly), and with --baseline the tokens/s against a third summary's
runs of the same names (the cost of what differs, e.g. --deterministic).

    python scripts/same_bits.py A/summary.json B/summary.json [--baseline C/summary.json]

Exits 1 when a run differs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _runs(path: Path) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads(path.read_text())["runs"]}


def compare(a: dict[str, dict], b: dict[str, dict]) -> list[tuple[str, str]]:
    """(run name, "identical" or where it first differs) for every run of a."""
    out = []
    for name, ra in a.items():
        rb = b.get(name)
        if rb is None:
            out.append((name, "missing in the second summary"))
            continue
        first = next((i for i, (x, y) in enumerate(zip(ra["losses"], rb["losses"], strict=True))
                      if x != y), None)  # fmt: skip
        if first is not None:
            out.append((name, f"DIFFERENT from step {first + 1}: {ra['losses'][first]!r} vs "
                              f"{rb['losses'][first]!r}"))  # fmt: skip
        elif ra["val_losses"] != rb["val_losses"]:
            out.append((name, f"DIFFERENT validation losses: {ra['val_losses']} vs "
                              f"{rb['val_losses']}"))  # fmt: skip
        else:
            out.append((name, f"identical ({len(ra['losses'])} steps)"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--baseline", type=Path, help="a summary of the same runs to compare tokens/s")
    args = p.parse_args()
    a, b = _runs(args.a), _runs(args.b)
    base = _runs(args.baseline) if args.baseline else {}
    ok = True
    for name, verdict in compare(a, b):
        ok &= verdict.startswith("identical")
        rate = ""
        if name in base and a[name].get("tokens_per_s") and base[name].get("tokens_per_s"):
            ratio = a[name]["tokens_per_s"] / base[name]["tokens_per_s"]
            rate = (f"; tokens/s {a[name]['tokens_per_s']:.0f} vs {base[name]['tokens_per_s']:.0f}"
                    f" without: {ratio:.3f}x")  # fmt: skip
        print(f"{name}: {verdict}{rate}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
