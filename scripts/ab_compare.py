"""Before/after table of two builds' `python -m benchmarks kernels --json` results, and the
bit-for-bit verdict of their kernel output digests (scripts/kernel_digest.py).

Rows are matched by their identity fields (op, shape, slots, history); only rows that both sides
measured are compared. Times are the median over each side's rounds; ratio = after / before, so
below 1 is faster. The copy row is the control: both sides time the same torch copy, so its ratio
shows how much the machine itself drifted between the runs.

    python scripts/ab_compare.py --before b1.json [b2.json] --after a1.json [a2.json]
        [--digests before.json after.json] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import statistics

ID_KEYS = ("op", "shape", "slots", "history")
# Times of graphfp8's kernels (lower is better), and of the peers they are compared with.
KERNEL_TIMES = ("cast_transpose_ms", "fused_ms", "norm_ms", "fused_eager_ms", "fused_gpu_us")
PEER_TIMES = ("copy_ms", "unfused_ms", "plain_eager_ms", "plain_gpu_us", "torch_ms")
SLOWER = 1.03  # flag a kernel more than 3% slower than before


def _rows(results: list[dict]) -> dict[tuple, list[dict]]:
    """(section, identity) -> that row in each round."""
    out: dict[tuple, list[dict]] = {}
    for result in results:
        for section, rows in result.items():
            if not isinstance(rows, list):
                continue
            for row in rows:
                ident = tuple((k, row[k]) for k in ID_KEYS if k in row)
                out.setdefault((section, ident), []).append(row)
    return out


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def compare(before: list[dict], after: list[dict]) -> tuple[list[list], int]:
    """Table rows [section, row id, metric, before, after, ratio, flag] and the count of kernels
    flagged slower."""
    b_rows, a_rows = _rows(before), _rows(after)
    table, slower = [], 0
    for key in b_rows:
        if key not in a_rows:
            continue
        section, ident = key
        name = " ".join(str(v) for _, v in ident)
        for metric in KERNEL_TIMES + PEER_TIMES:
            b, a = _median(b_rows[key], metric), _median(a_rows[key], metric)
            if b is None or a is None or b <= 0:
                continue
            ratio = a / b
            flag = ""
            if metric in KERNEL_TIMES and ratio > SLOWER:
                flag, slower = "SLOWER", slower + 1
            table.append([section, name, metric, b, a, ratio, flag])
    return table, slower


def digest_verdict(before: dict, after: dict) -> tuple[str, bool]:
    common = sorted(set(before) & set(after))
    differ = [k for k in common if before[k] != after[k]]
    only = sorted(set(before) ^ set(after))
    lines = [f"kernel outputs: {len(common) - len(differ)} of {len(common)} cases bit-identical"]
    lines += [f"  DIFFERS: {k}" for k in differ[:40]]
    if only:
        lines.append(f"  ({len(only)} cases measured on one side only, e.g. {only[0]})")
    return "\n".join(lines), not differ and bool(common)


def _markdown(table: list[list]) -> str:
    lines = ["| section | row | metric | before | after | after/before | |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for sec, name, metric, b, a, ratio, flag in table:
        lines.append(f"| {sec} | {name} | {metric} | {b:.4g} | {a:.4g} | {ratio:.3f} | {flag} |")
    return "\n".join(lines) + "\n"


def _load(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        with open(p) as f:
            out.append(json.load(f))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", nargs="+", required=True)
    parser.add_argument("--after", nargs="+", required=True)
    parser.add_argument("--digests", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--md", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    before, after = _load(args.before), _load(args.after)
    env_b, env_a = before[0].get("env", {}), after[0].get("env", {})
    text = (f"### kernel benchmark, before vs after ({env_a.get('gpu', env_a.get('device'))}, "
            f"{env_a.get('date')}; {len(before)} + {len(after)} rounds)\n\n")  # fmt: skip
    table, slower = compare(before, after)
    text += _markdown(table)
    text += f"\n{slower} kernel timings more than {SLOWER - 1:.0%} slower than before\n"
    ok = True
    if args.digests:
        d_before, d_after = _load(list(args.digests))  # one dict each
        verdict, ok = digest_verdict(d_before, d_after)
        text += "\n" + verdict + "\n"
    if env_b.get("torch") != env_a.get("torch"):
        text += f"\nWARNING: torch differs: {env_b.get('torch')} vs {env_a.get('torch')}\n"
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
