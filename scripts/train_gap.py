"""FP8 against bf16 in validation loss, over seeds, and the variants behind issue 27's diagnosis.

Trains the GPT preset once per (variant, seed) in one process - the same data, seed and initial
weights for every variant of a seed - and prints each variant's validation loss against bf16's of
the same seed (the paired difference), with the mean over seeds. One seed is not a measurement:
on the 100m preset two bf16 runs of different seeds ended 5-10% apart, and FP8 against bf16 of
one seed moved by as much as that (notes/NUMERICS.md). Variants:

    bf16          the baseline                   delayed      FP8 DelayedScaling as shipped
    current       Float8CurrentScaling           e4m3         DelayedScaling, Format.E4M3
    blockwise     Float8BlockScaling (1x128 tiles, 128x128 weight blocks; GRAPHFP8_BLOCKWISE_GEMM
                  chooses the CUDA GEMM)         blockwise_fp8w  the same, FP8 primary weights
    stats         delayed with --fp8-stats 10 (its tokens/s against delayed's: the report's cost)
    fp8_attn      delayed with FP8 attention (--fp8-attention; also against delayed)
    fp8_attn_e4m3 fp8_attn with the attention's backward in E4M3 (DelayedScaling(fp8_dpa_e4m3_bwd);
                  also against delayed: notes/FP8_ATTENTION.md)
    bwd_current   gradients current-scaled       fwd_current  forward tensors current-scaled
    w_current     only weights current-scaled    in_current   only GEMM inputs current-scaled
    no_fast       forward GEMMs without fast accumulation
    calib         a slot's first cast scaled from its own amax (fresh-slot calibration)
    uniform_bf16, uniform_delayed   torch.nn.Linear's initialisation (the preset's before 12-01)

    python scripts/train_gap.py --out DIR [--variants bf16,delayed,current] [--seeds 0,1,2]
        [--steps 300] [--preset 100m] [--stats-steps K] [--heads N] [--deterministic]

`--stats-steps K` then records the first K steps of an eager FP8 run with graphfp8.numerics.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from graphfp8.fp8.slots import BwdRole, FwdRole, Quantizer, slot_index
from graphfp8.modules import _functional
from graphfp8.modules._functional import GemmConfig
from graphfp8.numerics import FP8Stats, plot_stats, role_digest
from graphfp8.training.data import Dataset
from graphfp8.training.determinism import deterministic
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream


def _slot(cfg: GemmConfig, role):
    block = cfg.fwd if isinstance(role, FwdRole) else cfg.bwd
    i = slot_index(role, cfg.gemm)
    return block, i, block.arena, block.start + i


def _scale_from_h0_(arena, s: int) -> torch.Tensor:
    """The slot's scale from its H[0] by the update formula (kept when H[0] is 0 or not finite);
    returns the H[0] view."""
    a = arena.amax_history[0, s : s + 1]
    ok = torch.isfinite(a) & (a > 0)
    arena.scale[s : s + 1].copy_(torch.where(ok, arena.scaled_max[s : s + 1] / a,
                                             arena.scale[s : s + 1]))  # fmt: skip
    return a


@contextlib.contextmanager
def _patched_quantizer(quantizer):
    orig = GemmConfig.quantizer
    GemmConfig.quantizer = lambda self, role, amax_pass=None, **kw: quantizer(
        orig, self, role, amax_pass, **kw
    )
    try:
        yield
    finally:
        GemmConfig.quantizer = orig


def current_for(pred):
    """Casts whose role satisfies pred take a current scale (amax pass, one-slot update)."""

    def quantizer(orig, self, role, amax_pass, **kw):
        if not pred(role) or amax_pass is None:
            return orig(self, role, amax_pass, **kw)
        block, i, arena, s = _slot(self, role)
        q = Quantizer(block.scale(i), block.amax(i), arena.fp8_dtype)
        amax_pass(q)
        _scale_from_h0_(arena, s).zero_()
        return Quantizer(q.scale, arena.amax_sink, arena.fp8_dtype)

    return _patched_quantizer(quantizer)


def calibrate_fresh():
    """A slot's first cast ever takes its scale from its own amax (the amax pass, then the
    update formula on that one value, H[0] kept for the history); later casts are delayed."""
    done: set[tuple[int, int]] = set()

    def quantizer(orig, self, role, amax_pass, **kw):
        _, _, arena, s = _slot(self, role)
        if (arena.serial, s) in done or amax_pass is None:
            return orig(self, role, amax_pass, **kw)
        done.add((arena.serial, s))
        q = orig(self, role, None, **kw)
        amax_pass(q)
        _scale_from_h0_(arena, s)
        return q

    return _patched_quantizer(quantizer)


@contextlib.contextmanager
def no_fast_accum():
    orig = _functional.ops.fp8_gemm

    def gemm(*args, **kw):
        kw["use_fast_accum"] = False
        return orig(*args, **kw)

    _functional.ops.fp8_gemm = gemm
    try:
        yield
    finally:
        _functional.ops.fp8_gemm = orig


@contextlib.contextmanager
def uniform_init():
    """torch.nn.Linear's initialisation of the blocks (the GPT preset's before 2026-12-01)."""
    from graphfp8.training import model as model_mod

    orig = model_mod.init_normal
    model_mod.init_normal = None
    try:
        yield
    finally:
        model_mod.init_normal = orig


@contextlib.contextmanager
def attention_e4m3_bwd():
    """The run's DelayedScaling with fp8_dpa_e4m3_bwd wherever it sets fp8_dpa."""
    from graphfp8.training import run as run_mod

    orig = run_mod.DelayedScaling
    run_mod.DelayedScaling = lambda **kw: orig(**kw, fp8_dpa_e4m3_bwd=kw.get("fp8_dpa", False))
    try:
        yield
    finally:
        run_mod.DelayedScaling = orig


ATTENTION_VARIANTS = ("fp8_attn", "fp8_attn_e4m3")

VARIANTS = {
    "uniform_bf16": (dict(precision="bf16"), uniform_init),
    "uniform_delayed": ({}, uniform_init),
    "delayed": ({}, contextlib.nullcontext),
    "fp8_attn": (dict(fp8_attention=True), contextlib.nullcontext),
    "fp8_attn_e4m3": (dict(fp8_attention=True), attention_e4m3_bwd),
    "stats": ({}, contextlib.nullcontext),
    "bf16": (dict(precision="bf16"), contextlib.nullcontext),
    "current": (dict(scaling="current"), contextlib.nullcontext),
    "blockwise": (dict(scaling="blockwise"), contextlib.nullcontext),
    "blockwise_fp8w": (dict(scaling="blockwise", fp8_weights=True), contextlib.nullcontext),
    "e4m3": (dict(fp8_format="E4M3"), contextlib.nullcontext),
    "hist1": (dict(amax_history_len=1), contextlib.nullcontext),
    "bwd_current": ({}, lambda: current_for(lambda r: isinstance(r, BwdRole))),
    "fwd_current": ({}, lambda: current_for(lambda r: isinstance(r, FwdRole))),
    "w_current": ({}, lambda: current_for(lambda r: r == FwdRole.WEIGHT)),
    "in_current": ({}, lambda: current_for(lambda r: r == FwdRole.INPUT)),
    "no_fast": ({}, no_fast_accum),
    "calib": (dict(graphs="none"), calibrate_fresh),
}


def spec_for(name: str, seed: int, args) -> RunSpec:
    overrides, _ = VARIANTS[name]
    cfg = PRESETS[args.preset]
    if args.heads:
        cfg = dataclasses.replace(cfg, heads=args.heads)
    kw = dict(preset=args.preset, model=cfg, precision="fp8", graphs=args.graphs,
              microbatches=args.microbatches, device=args.device, seed=seed)  # fmt: skip
    kw.update(overrides)
    return RunSpec(**kw)


def paired_table(results: dict, seeds: list[int], against: str = "bf16") -> list[str]:
    """Each variant's validation loss against `against` of the same seed (bf16: uniform_*
    against uniform_bf16), per seed and mean; and its tokens/s against the reference's."""
    lines = [f"{'variant':16} " + " ".join(f"{'seed ' + str(s):>9}" for s in seeds)
             + f" {'mean':>8} {'val loss':>9} {'tok/s':>8} {'vs ' + against:>8}"]  # fmt: skip
    for name in dict.fromkeys(n for n, _ in results):
        ref = "uniform_bf16" if name.startswith("uniform_") and against == "bf16" else against
        diffs, vals, rates = [], [], []
        for s in seeds:
            r, b = results.get((name, s)), results.get((ref, s))
            if r is None:
                continue
            vals.append(r["final_val_loss"])
            rates.append((r["tokens_per_s"] or 0) / ((b or {}).get("tokens_per_s") or 1))
            if b is not None:
                diffs.append(100 * (r["final_val_loss"] / b["final_val_loss"] - 1))
        cells = " ".join(f"{d:+8.2f}%" for d in diffs).ljust(10 * len(seeds))
        mean = f"{sum(diffs) / len(diffs):+7.2f}%" if diffs else ""
        rate = sum(rates) / len(rates) if rates else 0.0
        tok_s = results[(name, seeds[0])]["tokens_per_s"] or 0
        lines.append(f"{name:16} {cells}{mean:>8} {sum(vals) / len(vals):9.4f} {tok_s:8.0f} "
                     f"{rate:7.2f}x")  # fmt: skip
    return lines


def record_stats(args, data: Dataset, out: Path) -> None:
    """Eager FP8 (as shipped) for --stats-steps steps, every cast measured."""
    spec = RunSpec(preset=args.preset, model=PRESETS[args.preset], precision="fp8", graphs="none",
                   microbatches=args.microbatches, device=args.device)  # fmt: skip
    run = Run(spec, data)
    run.prepare()
    stats = run.fp8_stats = FP8Stats(run.model)
    stats.enable(True)
    for _ in range(args.stats_steps):
        run.train_step(args.steps)
    stats.close()
    rows = stats.rows()
    print(f"wrote {stats.write_csv(out / 'fp8_stats.csv')} ({len(rows)} casts)")
    print(f"wrote {plot_stats(rows, out / 'fp8_stats.png')}")
    print(f"{'role':18} {'casts':>6} {'sat mean':>9} {'sat max':>9} {'unf mean':>9} "
          f"{'sqnr mean':>9} {'sqnr min':>9} {'amax !=':>8}")  # fmt: skip
    for key, d in role_digest(rows).items():  # None (a scale-and-amax role) prints as nan
        v = {k: math.nan if x is None else x for k, x in d.items()}
        print(f"{key:18} {d['casts']:6d} {v['saturated_mean']:9.2e} {v['saturated_max']:9.2e} "
              f"{v['underflow_mean']:9.2e} {v['sqnr_mean_db']:9.2f} {v['sqnr_min_db']:9.2f} "
              f"{d['amax_mismatches']:8d}")  # fmt: skip
    rows = [r for r in rows if r["sqnr_db"] is not None]
    worst = sorted(rows, key=lambda r: r["sqnr_db"])[:15]
    print("worst casts (lowest SQNR):")
    for r in worst:
        print(f"  step {r['step']} mb {r['microbatch']} {r['layer']} {r['gemm']} {r['role']}: "
              f"sqnr {r['sqnr_db']:.2f} sat {r['saturated_frac']:.2e} unf "
              f"{r['underflow_frac']:.2e} scale {r['scale']:.4g} amax rec {r['recorded_amax']:.4g}"
              f" true {r['true_amax']:.4g}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="bf16,delayed,current")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--preset", default="100m")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--graphs", default="layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--stats-steps", type=int, default=0)
    p.add_argument("--data", default="stdlib")
    p.add_argument("--val-batches", type=int, default=4, help="validation microbatches")
    p.add_argument(
        "--heads", type=int, help="the preset's attention heads replaced (every variant)"
    )
    p.add_argument("--deterministic", action="store_true", help="graphfp8-train --deterministic")
    args = p.parse_args()
    with deterministic(args.deterministic):
        train_all(args)


def train_all(args) -> None:
    """Every (variant, seed) in turn, then the paired tables (and --stats-steps' report)."""
    args.out.mkdir(parents=True, exist_ok=True)
    data = Dataset(open_stream(args.data), 0.01)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    results = {}
    for seed in seeds:
        for name in [v for v in args.variants.split(",") if v]:
            spec = spec_for(name, seed, args)
            t0 = time.perf_counter()
            opts = RunOptions(steps=args.steps, out=args.out / f"{name}_s{seed}", data=data,
                              log_every=10, fp8_stats=10 if name == "stats" else 0,
                              val_batches=args.val_batches)  # fmt: skip
            with VARIANTS[name][1]():
                r = train_run(spec, opts)
            r.pop("model_state", None)
            results[(name, seed)] = r
            losses = r["losses"]
            early = " ".join(f"{losses[i]:.3f}" for i in (0, 2, 4, 9, 29) if i < len(losses))
            print(f"{name:16} seed {seed} val {r['final_val_loss']:.4f} "
                  f"tok/s {r['tokens_per_s'] or 0:.0f}  train@1,3,5,10,30 {early}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    dump = {f"{n}_s{s}": r for (n, s), r in results.items()}
    (args.out / "train_gap.json").write_text(json.dumps(dump, indent=1))
    table = paired_table(results, seeds)
    heads = f", --heads {args.heads}" if args.heads else ""
    title = (f"{args.preset}{heads}, {args.steps} steps x {args.microbatches} microbatches, "
             f"--data {args.data}, deterministic {args.deterministic}: validation loss "
             "against")  # fmt: skip
    if ("delayed", seeds[0]) in results and any((v, seeds[0]) in results
                                                for v in ATTENTION_VARIANTS):  # fmt: skip
        attn = {k: v for k, v in results.items() if k[0] in ("delayed", *ATTENTION_VARIANTS)}
        table += ["", f"{title} FP8 without FP8 attention", *paired_table(attn, seeds, "delayed")]
    (args.out / "train_gap.md").write_text("\n".join(table) + "\n")
    print(f"\n{title} bf16 of the same seed")
    print("\n".join(table))
    if args.stats_steps:
        record_stats(args, data, args.out)


if __name__ == "__main__":
    main()
