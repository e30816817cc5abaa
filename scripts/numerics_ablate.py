"""Issue 27's diagnosis: which part of the FP8 path makes DelayedScaling train worse than bf16.

Trains the GPT preset once per variant in one process (same data, seed and initial weights) and
prints each variant's validation loss against bf16's. A variant switches one suspect off by
patching the layers for the length of its run (scripts only; nothing here is runtime code):

    bf16         the baseline              base         FP8 DelayedScaling as shipped
    current      Float8CurrentScaling      bwd_current  gradients current-scaled, forward delayed
    fwd_current  forward current-scaled    w_current    only weights current-scaled
    in_current   only GEMM inputs current  no_fast      forward GEMMs without fast accumulation
    e4m3         Format.E4M3               hist1        amax_history_len 1
    calib        a slot's first cast scaled from its own amax (fresh-slot calibration)
    *_normal     TransformerEngine's initialisation (normal(0, 0.02) weights, zero biases)
    *_s1, _s2, _s3  seeds 1-3 (the run-to-run spread)

Then `--stats-steps K` records the first K steps of an eager FP8 run with graphfp8.numerics and
writes every cast's statistics (fp8_stats.csv) and a per-role digest.

    python scripts/numerics_ablate.py --out DIR [--runs bf16,base,...] [--steps 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from graphfp8.fp8.slots import BwdRole, FwdRole, Quantizer, slot_index
from graphfp8.modules import _functional
from graphfp8.modules._functional import GemmConfig
from graphfp8.numerics import FP8Stats, plot_stats
from graphfp8.training.data import Dataset
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream


@contextlib.contextmanager
def current_for(pred):
    """Casts whose role satisfies pred take a current scale (amax pass, one-slot update)."""
    orig = GemmConfig.quantizer

    def quantizer(self, role, amax_pass=None):
        if not pred(role) or amax_pass is None:
            return orig(self, role, amax_pass)
        block = self.fwd if isinstance(role, FwdRole) else self.bwd
        i = slot_index(role, self.gemm)
        arena, s = block.arena, block.start + i
        q = Quantizer(block.scale(i), block.amax(i), arena.fp8_dtype)
        amax_pass(q)
        a = arena.amax_history[0, s : s + 1]
        ok = torch.isfinite(a) & (a > 0)
        arena.scale[s : s + 1].copy_(torch.where(ok, arena.scaled_max[s : s + 1] / a,
                                                 arena.scale[s : s + 1]))  # fmt: skip
        a.zero_()
        return Quantizer(q.scale, arena.amax_sink, arena.fp8_dtype)

    GemmConfig.quantizer = quantizer
    try:
        yield
    finally:
        GemmConfig.quantizer = orig


@contextlib.contextmanager
def calibrate_fresh():
    """A slot's first cast ever takes its scale from its own amax (the amax pass, then the
    update formula on that one value, H[0] kept for the history); later casts are delayed."""
    orig = GemmConfig.quantizer
    done: set[tuple[int, int]] = set()

    def quantizer(self, role, amax_pass=None):
        block = self.fwd if isinstance(role, FwdRole) else self.bwd
        i = slot_index(role, self.gemm)
        arena, s = block.arena, block.start + i
        if (arena.serial, s) in done or amax_pass is None:
            return orig(self, role, amax_pass)
        done.add((arena.serial, s))
        q = orig(self, role, None)
        amax_pass(q)
        a = arena.amax_history[0, s : s + 1]
        ok = torch.isfinite(a) & (a > 0)
        arena.scale[s : s + 1].copy_(torch.where(ok, arena.scaled_max[s : s + 1] / a,
                                                 arena.scale[s : s + 1]))  # fmt: skip
        return q

    GemmConfig.quantizer = quantizer
    try:
        yield
    finally:
        GemmConfig.quantizer = orig


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
def normal_init():
    """TransformerEngine's initialisation: GEMM weights normal(0, 0.02), biases 0 (instead of
    torch.nn.Linear's uniform(+-1/sqrt(in)), whose density is flat up to the amax)."""
    from graphfp8.training import run as run_mod

    orig = run_mod.GPT

    class NormalGPT(orig):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            with torch.no_grad():
                for name, p in self.blocks.named_parameters():
                    if name.endswith("weight") and p.dim() == 2:
                        p.normal_(0.0, 0.02)
                    elif name.endswith("bias") and "layer_norm" not in name:
                        p.zero_()

    run_mod.GPT = NormalGPT
    try:
        yield
    finally:
        run_mod.GPT = orig


VARIANTS = {
    "bf16_normal": (dict(precision="bf16"), normal_init),
    "base_normal": ({}, normal_init),
    "bf16": (dict(precision="bf16"), contextlib.nullcontext),
    "bf16_s1": (dict(precision="bf16", seed=1), contextlib.nullcontext),
    "base": ({}, contextlib.nullcontext),
    "base_s1": (dict(seed=1), contextlib.nullcontext),
    "current": (dict(scaling="current"), contextlib.nullcontext),
    "e4m3": (dict(fp8_format="E4M3"), contextlib.nullcontext),
    "hist1": (dict(amax_history_len=1), contextlib.nullcontext),
    "bwd_current": ({}, lambda: current_for(lambda r: isinstance(r, BwdRole))),
    "fwd_current": ({}, lambda: current_for(lambda r: isinstance(r, FwdRole))),
    "w_current": ({}, lambda: current_for(lambda r: r == FwdRole.WEIGHT)),
    "in_current": ({}, lambda: current_for(lambda r: r == FwdRole.INPUT)),
    "no_fast": ({}, no_fast_accum),
    "calib": (dict(graphs="none"), calibrate_fresh),
}
for _seed in (1, 2, 3):
    for _name in ("bf16", "base", "calib", "bf16_normal", "base_normal"):
        _over, _ctx = VARIANTS[_name]
        VARIANTS.setdefault(f"{_name}_s{_seed}", ({**_over, "seed": _seed}, _ctx))


def spec_for(name: str, args, vocab: int) -> RunSpec:
    overrides, _ = VARIANTS[name]
    cfg = PRESETS[args.preset]
    kw = dict(preset=args.preset, model=cfg, precision="fp8", graphs=args.graphs,
              microbatches=args.microbatches, device=args.device)  # fmt: skip
    kw.update(overrides)
    return RunSpec(**kw)


def record_stats(args, data: Dataset, out: Path) -> None:
    """Eager FP8 (as shipped) for --stats-steps steps, every cast measured."""
    spec = RunSpec(preset=args.preset, model=PRESETS[args.preset], precision="fp8", graphs="none",
                   microbatches=args.microbatches, device=args.device)  # fmt: skip
    run = Run(spec, data)
    run.prepare()
    stats = FP8Stats(run.model)
    for step in range(args.stats_steps):
        with stats.record(step):
            run.train_step(args.steps)
    rows = stats.rows()
    print(f"wrote {stats.write_csv(out / 'fp8_stats.csv')} ({len(rows)} casts)")
    print(f"wrote {plot_stats(rows, out / 'fp8_stats.png')}")
    digest: dict[str, dict] = {}
    for r in rows:
        key = f"{r['gemm']}.{r['role']}" if r["gemm"] else r["role"]
        d = digest.setdefault(key, dict(n=0, sat_max=0.0, sat_sum=0.0, unf_sum=0.0, sqnr_min=1e9,
                                        sqnr_sum=0.0, amax_mismatch=0))  # fmt: skip
        d["n"] += 1
        d["sat_max"] = max(d["sat_max"], r["saturated_frac"])
        d["sat_sum"] += r["saturated_frac"]
        d["unf_sum"] += r["underflow_frac"]
        d["sqnr_min"] = min(d["sqnr_min"], r["sqnr_db"])
        d["sqnr_sum"] += r["sqnr_db"]
        d["amax_mismatch"] += r["recorded_amax"] != r["true_amax"]
    print(f"{'role':18} {'casts':>6} {'sat mean':>9} {'sat max':>9} {'unf mean':>9} "
          f"{'sqnr mean':>9} {'sqnr min':>9} {'amax !=':>8}")  # fmt: skip
    for key, d in sorted(digest.items()):
        n = d["n"]
        print(f"{key:18} {n:6d} {d['sat_sum'] / n:9.2e} {d['sat_max']:9.2e} "
              f"{d['unf_sum'] / n:9.2e} {d['sqnr_sum'] / n:9.2f} {d['sqnr_min']:9.2f} "
              f"{d['amax_mismatch']:8d}")  # fmt: skip
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
    p.add_argument("--runs", default="bf16,base,current,bwd_current,fwd_current,w_current,"
                   "in_current,no_fast,bf16_s1,base_s1")  # fmt: skip
    p.add_argument("--preset", default="100m")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--graphs", default="layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--stats-steps", type=int, default=0)
    p.add_argument("--data", default="stdlib")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = Dataset(open_stream(args.data), 0.01)
    results = {}
    for name in [r for r in args.runs.split(",") if r]:
        spec = spec_for(name, args, data.vocab_size)
        t0 = time.perf_counter()
        with VARIANTS[name][1]():
            r = train_run(spec, RunOptions(steps=args.steps, out=args.out / name, data=data,
                                           log_every=10))  # fmt: skip
        r.pop("model_state", None)
        results[name] = r
        losses = r["losses"]
        early = " ".join(f"{losses[i]:.3f}" for i in (0, 2, 4, 9, 29) if i < len(losses))
        print(f"{name:12} val {r['final_val_loss']:.4f}  train@1,3,5,10,30 {early}  "
              f"{time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    (args.out / "ablate.json").write_text(json.dumps(results, indent=1))
    if "bf16" in results:
        ref = results["bf16"]["final_val_loss"]
        print(f"\n{'variant':12} {'val loss':>9} {'vs bf16':>8}")
        for name, r in results.items():
            v = r["final_val_loss"]
            print(f"{name:12} {v:9.4f} {100 * (v / ref - 1):+7.2f}%")
    if args.stats_steps:
        record_stats(args, data, args.out)


if __name__ == "__main__":
    main()
