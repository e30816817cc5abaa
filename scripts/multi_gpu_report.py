"""The tables of scripts/multi_gpu.sh (issue 34; docs/sharding.md, "Multi-GPU measurement"), from
what its parts wrote into one folder:

    corr_<preset>/, corr_<preset>-shard/   graphfp8-train --check-replicas summaries (eager, step)
    speed_N.json, speed_1_part*.json       benchmarks/multi_gpu.py at N GPUs and the 1-GPU baselines
    peers_N.json                           benchmarks/fsdp_peers.py at N GPUs
    fit/fit.json                           benchmarks/multi_gpu_fit.py
    tests.log                              the CUDA tests of tests/sharding

    python scripts/multi_gpu_report.py DIR   (writes DIR/multi_gpu.md and DIR/multi_gpu.json)

Prints the markdown; exit status 1 when a correctness check failed (replicas, eager == step).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def rel_diff(a: list[float], b: list[float]) -> tuple[float, int | None]:
    """(max relative difference, first step (1-based) where they differ or None)."""
    worst, first = 0.0, None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y and first is None:
            first = i + 1
        worst = max(worst, abs(x - y) / max(abs(y), 1e-30))
    return worst, first


def compare_correctness(unsharded: dict, sharded: dict) -> dict:
    """Two graphfp8-train --check-replicas summaries (runs eager, step) of one preset.

    Returns:
        {"<run>": {"replicas", "checks", "eager_equals_step"}, "sharded_vs_unsharded":
        {"losses_equal", "max_rel_diff", "first_diff_step", "weights_equal_steps", "steps"}}.
    """
    out, ok = {}, True
    for summary in (unsharded, sharded):
        eager, step = summary["runs"]
        e, s = eager["replicas"], step["replicas"]
        same = (
            e["losses_per_rank"] == s["losses_per_rank"] and e["step_digests"] == s["step_digests"]
        )
        for r in (eager, step):
            out[r["name"]] = {"replicas": r["replicas"]["identical"],
                              "checks": r["replicas"]["steps_checked"],
                              "eager_equals_step": same}  # fmt: skip
        ok = ok and same
    a, b = unsharded["runs"][1], sharded["runs"][1]  # the step graphs
    worst, first = rel_diff(b["losses"], a["losses"])
    da, db = a["replicas"]["step_digests"], b["replicas"]["step_digests"]
    equal_steps = next((i for i, (x, y) in enumerate(zip(da, db, strict=False)) if x != y),
                       min(len(da), len(db)))  # fmt: skip
    out["sharded_vs_unsharded"] = {"losses_equal": a["losses"] == b["losses"],
                                   "max_rel_diff": worst, "first_diff_step": first,
                                   "weights_equal_steps": equal_steps,
                                   "steps": len(a["losses"])}  # fmt: skip
    out["ok"] = ok
    return out


def _correctness(d: Path) -> tuple[list[str], dict, bool]:
    lines = ["### Correctness: --ddp vs --ddp --shard, --fp8-weights --deterministic "
             "--check-replicas (replicas identical: at the start and after every step, checks)",
             "", "| preset | --ddp: replicas identical, eager == step graph on every rank | "
             "--ddp --shard: the same | sharded vs unsharded (step graphs) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    found, ok = {}, True
    for unsharded_dir in sorted(p for p in d.glob("corr_*") if p.is_dir()):
        if unsharded_dir.name.endswith("-shard"):
            continue
        preset = unsharded_dir.name[len("corr_") :]
        a = _load(unsharded_dir / "summary.json")
        b = _load(d / f"corr_{preset}-shard" / "summary.json")
        if a is None or b is None:
            lines.append(f"| {preset} | {'ok' if a else 'missing'} | {'ok' if b else 'missing'} "
                         "| - |")  # fmt: skip
            ok = False
            continue
        c = compare_correctness(a, b)
        found[preset], ok = c, ok and c["ok"]
        cells = []
        for summary in (a, b):
            runs = [c[r["name"]] for r in summary["runs"]]
            checks = "/".join(str(r["checks"]) for r in runs)
            cells.append(f"{'yes' if all(r['replicas'] for r in runs) else 'NO'} ({checks}), "
                         f"{'yes' if runs[0]['eager_equals_step'] else 'NO'}")  # fmt: skip
        v = c["sharded_vs_unsharded"]
        vs = ("bit for bit" if v["losses_equal"] else
              f"losses: max rel diff {v['max_rel_diff']:.2e}, first at step "
              f"{v['first_diff_step']}; weights equal for the first {v['weights_equal_steps']} "
              "checks")  # fmt: skip
        lines.append(f"| {preset} | {cells[0]} | {cells[1]} | {vs} |")
    return lines, found, ok


def _speed_rows(d: Path) -> tuple[dict, dict, list]:
    n_run = _load(d / "speed_N.json") or {"runs": [], "profiles": [], "environment": {}}
    ones = [
        r for p in sorted(d.glob("speed_1_part*.json")) for r in (_load(p) or {}).get("runs", [])
    ]
    world = n_run["environment"].get("world", 1)
    if world == 1:
        ones = n_run["runs"]
    base = {(r["preset"], r["config"], r["mode"]): r for r in ones if r.get("tokens_per_s")}
    return n_run, base, n_run.get("profiles", [])


def _peak(r: dict) -> float:
    return max(m["max_allocated_bytes"] or 0 for m in r["memory_per_rank"]) / GIB


def _bpp(r: dict) -> float:
    return max(m["state_bytes_per_parameter"]["total"] for m in r["memory_per_rank"])


def target_bpp(config: str, world: int) -> float:
    """docs/sharding.md's state bytes per parameter per GPU: FP8 with bf16 parameters 10
    unsharded; sharded 2 + 2 + 2 + 16/N (bf16 parameters) or 2 + 2 + 16/N (FP8 weights)."""
    return {"ddp": 10.0, "shard": 6 + 16 / world, "shard-fp8w": 4 + 16 / world}[config]


def _speed(d: Path) -> tuple[list[str], dict]:
    n_run, base, _ = _speed_rows(d)
    world = n_run["environment"].get("world", 1)
    lines = [f"### Speed and memory at N={world} (tokens/s of all GPUs; efficiency = tokens/s at "
             "N / (N x tokens/s on 1 GPU))", "",
             "| preset | config | graphs | tokens/s N | tokens/s 1 | efficiency | vs ddp | "
             "max_allocated GiB | state B/param | target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    rows = []
    for r in n_run["runs"]:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['config']} | {r['mode']} | {r['error'][:60]} "
                         "| | | | | | |")  # fmt: skip
            continue
        one = base.get((r["preset"], r["config"], r["mode"]))
        ddp = next((x for x in n_run["runs"] if x.get("tokens_per_s") and x["config"] == "ddp"
                    and (x["preset"], x["mode"]) == (r["preset"], r["mode"])), None)  # fmt: skip
        eff = r["tokens_per_s"] / (world * one["tokens_per_s"]) if one else None
        row = {**{k: r[k] for k in ("preset", "config", "mode", "tokens_per_s")},
               "tokens_per_s_1": one["tokens_per_s"] if one else None, "efficiency": eff,
               "vs_ddp": r["tokens_per_s"] / ddp["tokens_per_s"] if ddp else None,
               "max_allocated_gib": _peak(r), "state_bytes_per_parameter": _bpp(r),
               "target": target_bpp(r["config"], world)}  # fmt: skip
        rows.append(row)
        fmt = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
        lines.append(f"| {r['preset']} | {r['config']} | {r['mode']} | {r['tokens_per_s']:,.0f} | "
                     f"{fmt(row['tokens_per_s_1'], ',.0f')} | {fmt(eff, '.3f')} | "
                     f"{fmt(row['vs_ddp'], '.3f')} | {row['max_allocated_gib']:.2f} | "
                     f"{row['state_bytes_per_parameter']:.2f} | {row['target']:.2f} |")  # fmt: skip
    left = [f"{r['preset']} {r['config']}:{r['mode']} {r['allocated_before_bytes'] / GIB:.2f}"
            for r in n_run["runs"] if (r.get("allocated_before_bytes") or 0) > GIB / 4]  # fmt: skip
    if left:  # an earlier run's memory still allocated: its peak counts in the next ones'
        lines.append(f"\nGiB allocated before the run (left by earlier runs): {', '.join(left)}")
    return lines, {"world": world, "environment": n_run["environment"], "rows": rows}


def _profiles(d: Path) -> tuple[list[str], list]:
    _, _, profiles = _speed_rows(d)
    lines = ["### One profiled step at N: NCCL kernels against compute (rank 0; max over ranks)",
             "", "| run | steps | NCCL busy ms/step | share of the span | overlapped with "
             "compute | exposed ms/step | NCCL window | by collective (ms/step) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for p in profiles:
        r0, steps = p["per_rank"][0], p["per_rank"][0]["steps"]
        worst = max(x.get("nccl_busy_us", 0.0) for x in p["per_rank"]) / steps / 1e3
        if not r0.get("kernels"):
            lines.append(f"| {p['preset']} {p['name']} | {steps} | no GPU kernels seen | | | | | |")
            continue
        kinds = ", ".join(f"{k} {v['us'] / steps / 1e3:.2f}" for k, v in r0["by_kind"].items())
        over = r0["nccl_overlapped"]
        busy = r0["nccl_busy_us"] / steps / 1e3
        lines.append(f"| {p['preset']} {p['name']} | {steps} | {busy:.2f} ({worst:.2f}) | "
                     f"{r0['nccl_share']:.3f} | "
                     f"{'-' if over is None else f'{over:.3f}'} | "
                     f"{r0['nccl_exposed_us'] / steps / 1e3:.2f} | {r0['nccl_window']} | "
                     f"{kinds} |")  # fmt: skip
    return lines, profiles


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _peers(d: Path, speed: dict) -> tuple[list[str], list]:
    peers = (_load(d / "peers_N.json") or {}).get("runs", [])
    world = speed["world"]
    head = ("preset", "peer", "tokens/s", "vs graphfp8 shard-fp8w step",
            "max_allocated GiB per GPU (max rank)", "loss at the end", "host ms / step (enqueue)",
            "ms / step", "GPU busy (profiled)")  # fmt: skip
    lines = [f"### Peers at N={world}: the same shapes and data (FSDP2 per block, torch.compile'd "
             "blocks)", "", "| " + " | ".join(head) + " |",
             "|" + " --- |" * len(head)]  # fmt: skip
    ours = {(r["preset"], r["config"], r["mode"]): r for r in speed["rows"]}
    for preset in sorted({p["preset"] for p in peers}):
        ref = ours.get((preset, "shard-fp8w", "step"))
        for config in ("ddp", "shard", "shard-fp8w"):
            r = ours.get((preset, config, "step"))
            if r is not None:
                lines.append(f"| {preset} | graphfp8 {config} step graph | "
                             f"{r['tokens_per_s']:,.0f} | "
                             f"{r['tokens_per_s'] / ref['tokens_per_s'] if ref else 0:.3f} | "
                             f"{r['max_allocated_gib']:.2f} | | | | |")  # fmt: skip
        for p in (p for p in peers if p["preset"] == preset):
            if "tokens_per_s" not in p:
                lines.append(f"| {preset} | {p['peer']} | {p.get('skipped') or p.get('error')} "
                             "| | | | | | |")  # fmt: skip
                continue
            vs = f"{p['tokens_per_s'] / ref['tokens_per_s']:.3f}" if ref else "-"
            peak = max(x or 0 for x in p["max_allocated_bytes"]) / GIB
            busy = (p.get("profile") or {}).get("busy_fraction")
            lines.append(f"| {preset} | {p['peer']} | {p['tokens_per_s']:,.0f} | {vs} | "
                         f"{peak:.2f} | {p['losses'][-1]:.4f} | {_num(p.get('host_ms_per_step'))} "
                         f"| {_num(p.get('ms_per_step'))} | {_num(busy)} |")  # fmt: skip
    return lines, peers


def _fit(d: Path) -> tuple[list[str], dict | None]:
    fit = _load(d / "fit" / "fit.json")
    if fit is None:
        return ["### Largest model that trains: not run", ""], None
    lines = [f"### Largest model that trains at N={fit['world']} (sharded, FP8 weights, step "
             f"graph, {fit['microbatches']} microbatch(es) of the 100m batch; predicted against "
             f"{fit['headroom']:.0%} of {fit['capacity_bytes'] / GIB:.1f} GiB)", "",
             "| shape | parameters | predicted GiB | predicted fit | trained |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    tried = dict((n, ok) for n, ok in fit["tried"])
    for r in fit["predictions"]:
        trained = {True: "yes", False: "no (out of memory or failed)"}.get(
            tried.get(r["name"]), "-"
        )
        lines.append(f"| {r['name']} | {r['parameters'] / 1e9:.2f}B | "
                     f"{r['predicted_bytes'] / GIB:.1f} | {'yes' if r['fits'] else 'no'} | "
                     f"{trained} |")  # fmt: skip
    lines.append(f"\nlargest that trains: {fit['largest_fitting']}; next larger: "
                 f"{fit['next_larger_fails'] or 'not tried'}")  # fmt: skip
    return lines, fit


def main(folder: str) -> int:
    d = Path(folder)
    tests = (
        (d / "tests.log").read_text().strip().splitlines()[-1:]
        if (d / "tests.log").exists()
        else []
    )
    corr_lines, corr, ok = _correctness(d)
    speed_lines, speed = _speed(d)
    profile_lines, profiles = _profiles(d)
    peer_lines, peers = _peers(d, speed)
    fit_lines, fit = _fit(d)
    env = speed["environment"]
    head = [f"## Sharded FP8 training on {env.get('world', '?')} x {env.get('gpu', '?')} "
            f"({env.get('date', '?')}; torch {env.get('torch', '?')}, NCCL {env.get('nccl', '?')})",
            "", f"CUDA tests of tests/sharding: {tests[0] if tests else 'not run'}",
            ""]  # fmt: skip
    text = "\n".join([*head, *corr_lines, "", *speed_lines, "", *profile_lines, "", *peer_lines,
                      "", *fit_lines]) + "\n"  # fmt: skip
    (d / "multi_gpu.md").write_text(text)
    (d / "multi_gpu.json").write_text(json.dumps({"environment": env, "tests": tests,
                                                "correctness": corr, "speed": speed["rows"],
                                                "profiles": profiles, "peers": peers,
                                                "fit": fit}, indent=1) + "\n")  # fmt: skip
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
