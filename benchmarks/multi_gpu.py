"""Data-parallel scaling of graphfp8-train (issue 34; docs/sharding.md, "Multi-GPU measurement"):
tokens/s and memory per GPU of unsharded DDP (`--ddp`), `--ddp --shard` and `--ddp --shard
--fp8-weights`, each with layer graphs and with the step graph, for the given presets, all in one
process per rank (one start-up, runs one after the other through training/loop.py's train_run, as
graphfp8-train runs them); then a torch.profiler trace of a few steps of the chosen runs,
summarised per rank as the NCCL kernels' busy time and its overlap with compute (overlap.py).

    torchrun --nproc_per_node N -m benchmarks.multi_gpu --json speed.json --profile ddp:step
    CUDA_VISIBLE_DEVICES=i torchrun --nproc_per_node 1 -m benchmarks.multi_gpu --part i/k ...

`--part i/k` runs every k-th run from the i-th: the 1-GPU baselines spread over a machine's GPUs,
one process each (scripts/multi_gpu.sh). The JSON is rewritten after every run, so a run stopped by
its time limit keeps what finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import environment
from benchmarks.multi_gpu_fit import FIT_SHAPES
from benchmarks.overlap import collective_summary
from graphfp8 import reset_state
from graphfp8.distributed import gather_objects
from graphfp8.training.data import Dataset
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream
from graphfp8.training.step_profile import profile_steps, trace_name
from graphfp8.training.trace_stats import kernel_events

__all__ = ["CONFIGS", "main", "plan", "profile_run", "run"]

# name: (shard, fp8_weights), as graphfp8-train's --shard and --fp8-weights
CONFIGS = {"ddp": (False, False), "shard": (True, False), "shard-fp8w": (True, True)}
PROFILE_WARMUP = 3


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.multi_gpu")
    p.add_argument("--presets", default="100m,300m", help="graphfp8-train presets or "
                   "benchmarks/multi_gpu_fit.py's shapes (1b ... 64b)")  # fmt: skip
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {CONFIGS}")
    p.add_argument("--modes", default="layers,step", help="graph modes (none, layers, step)")
    p.add_argument("--steps", type=int, default=30, help="per run; tokens/s after the first 10%%")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, help="sequences per microbatch (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="(default: the preset's)")
    p.add_argument("--part", default="0/1", metavar="I/K", help="only runs I, I+K, I+2K, ...")
    p.add_argument(
        "--profile",
        default="",
        metavar="CONFIG:MODE,...",
        help="profile these runs of the first preset after the speed runs",
    )
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--trace", help="folder for rank 0's Chrome traces (default: none kept)")
    p.add_argument("--data", default="synthetic", help="as graphfp8-train's --data")
    p.add_argument("--json", help="write the results here (rank 0)")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(preset, config, mode) of every run of this --part, in order."""
    part, parts = (int(x) for x in args.part.split("/"))
    return [(p, c, m) for p in args.presets.split(",") for c in args.configs.split(",")
            for m in args.modes.split(",")][part::parts]  # fmt: skip


def _spec(args, preset: str, config: str, mode: str, device: str, vocab: int) -> RunSpec:
    shard, fp8_weights = CONFIGS[config]
    cfg = replace({**PRESETS, **FIT_SHAPES}[preset], vocab=vocab)
    cfg = replace(cfg, batch=args.batch or cfg.batch, seq_len=args.seq_len or cfg.seq_len)
    return RunSpec(preset=preset, model=cfg, precision="fp8", graphs=mode,
                   microbatches=args.microbatches, device=device, fp8_weights=fp8_weights,
                   shard=shard)  # fmt: skip


def _release(device: str) -> int | None:
    """Frees the previous run (its live captures, graphs and pools: graphfp8.reset_state, as
    between tests). Returns the bytes still allocated on the GPU (None on the CPU)."""
    reset_state()
    gc.collect()
    if not device.startswith("cuda"):
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _measure(spec: RunSpec, args, data: Dataset, group, out: Path) -> dict:
    """One run through train_run: tokens/s (all ranks), capture time, each rank's peak and
    state bytes per parameter; an exception (out of memory) is the result instead."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    head = {"preset": spec.preset, "config": _config_of(spec), "mode": spec.graphs,
            "world": world, "name": spec.name}  # fmt: skip
    head["allocated_before_bytes"] = _release(spec.device)  # what an earlier run left behind
    opts = RunOptions(steps=args.steps, out=out, data=data, log_every=args.steps,
                      eval_every=args.steps, group=group, world_size=world,
                      is_main=rank == 0)  # fmt: skip
    try:
        r = train_run(spec, opts)
    except Exception as exc:  # noqa: BLE001 - recorded; the next run goes on
        _release(spec.device)
        return {**head, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    memory = [{"rank": m["rank"], "max_allocated_bytes": m["max_allocated_bytes"],
               "state_bytes_per_parameter": m["state"]["bytes_per_parameter"]}
              for m in r["memory_per_rank"]]  # fmt: skip
    return {**head, "parameters": r["parameters"], "tokens_per_s": r["tokens_per_s"],
            "capture_s": r["capture_s"], "first_loss": r["losses"][0],
            "final_loss": r["final_loss"], "memory_per_rank": memory}  # fmt: skip


def _config_of(spec: RunSpec) -> str:
    return next(k for k, v in CONFIGS.items() if v == (spec.shard, spec.fp8_weights))


def profile_run(spec: RunSpec, data: Dataset, group, steps: int, trace: Path | None) -> dict:
    """`steps` steps of `spec` (after PROFILE_WARMUP) under torch.profiler. Returns every
    rank's benchmarks/overlap.py collective_summary (rank order), with its kernel count."""
    _release(spec.device)
    run = Run(spec, data, group)
    run.prepare()
    total = PROFILE_WARMUP + steps
    for _ in range(PROFILE_WARMUP):
        run.train_step(total)
    prof = profile_steps(run, steps, total)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in kernel_events(prof)]
    mine = {**collective_summary(kernels), "kernels": len(kernels), "steps": steps}
    if trace is not None and dist.get_rank(group) == 0:
        trace.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace / trace_name(run)))
    every = gather_objects(mine, group)
    del run, prof
    _release(spec.device)
    return {"preset": spec.preset, "config": _config_of(spec), "mode": spec.graphs,
            "name": spec.name, "per_rank": every}  # fmt: skip


def _environment(device: str, world: int) -> dict:
    """benchmarks/common.py's environment, with the world size and NCCL's version."""
    env = {**environment(device), "world": world}
    if device.startswith("cuda"):
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def run(argv, group, device: str) -> dict:
    """The runs of `argv` (see _parse) on the ranks of `group`, this rank on `device`. Returns
    (and on rank 0 writes to --json after every run) {"environment", "runs", "profiles"}."""
    args = _parse(argv)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    data = Dataset(open_stream(args.data, None, 4 << 20, 0), val_fraction=0.0)
    todo = plan(args)
    out = {"environment": _environment(device, world), "part": args.part, "runs": [],
           "profiles": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="graphfp8_scaling_") as tmp:
        for preset, config, mode in todo:
            spec = _spec(args, preset, config, mode, device, data.vocab_size)
            out["runs"].append(_measure(spec, args, data, group, Path(tmp)))
            _write(out, args.json, rank)
    trace = Path(args.trace) if args.trace else None
    for target in filter(None, args.profile.split(",")):
        config, mode = target.split(":")
        spec = _spec(args, args.presets.split(",")[0], config, mode, device, data.vocab_size)
        out["profiles"].append(profile_run(spec, data, group, args.profile_steps, trace))
        _write(out, args.json, rank)
    return out


def _write(out: dict, path: str | None, rank: int) -> None:
    if rank == 0 and path:
        Path(path).write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> int:
    from graphfp8.distributed import cleanup, init_distributed

    info = init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        print("benchmarks.multi_gpu runs under torchrun: torchrun --nproc_per_node N -m "
              "benchmarks.multi_gpu ...")  # fmt: skip
        return 2
    try:
        out = run(argv, dist.group.WORLD, str(info.device))
    finally:
        cleanup()
    if info.rank == 0:
        for r in out["runs"]:
            tps = r.get("tokens_per_s")
            print(f"{r['preset']} {r['config']}:{r['mode']} x{r['world']}: "
                  f"{f'{tps:,.0f} tokens/s' if tps else r.get('error', '-')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
