"""Drives one Run through its steps: timing, validation, logging, progress and checkpoints."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphfp8.distributed import gather_objects
from graphfp8.distributed.replica_check import ReplicaCheck
from graphfp8.numerics import FP8Stats, plot_stats, role_digest
from graphfp8.numerics_blockwise import BlockStats
from graphfp8.training.checkpoint import (
    CheckpointError,
    check_resumable,
    load_checkpoint,
    load_sharded_run,
    save_checkpoint,
    save_sharded_run,
)
from graphfp8.training.data import Dataset
from graphfp8.training.evaluate import validation_loss
from graphfp8.training.interrupt import StopAtStepBoundary
from graphfp8.training.model import count_parameters
from graphfp8.training.report import MetricsLog, Progress, final_loss, rank_memory
from graphfp8.training.run import Run, RunSpec, run_settings
from graphfp8.training.speed import speed_fields

__all__ = ["RunOptions", "sync", "train_run"]


@dataclass
class RunOptions:
    steps: int  # the run's length: the LR schedule spans it
    out: Path
    data: Dataset = field(default=None, repr=False)
    log_every: int = 10
    eval_every: int | None = None  # validation every N steps and at the end; None: steps // 10
    val_batches: int = 4  # validation set size, in microbatch-sized batches (all ranks together)
    save: Path | None = None
    resume: Path | None = None
    group: object = None
    world_size: int = 1
    is_main: bool = True
    keep_state: bool = False  # return the final model state_dict (tests)
    stop_at: int | None = None  # end early after this step (e.g. save, resume later)
    fp8_stats: int = 0  # record every FP8 cast's statistics every N steps (0: never)
    check_replicas: bool = False  # the weights' digests compared across ranks after every step

    @property
    def every(self) -> int:
        return self.eval_every or max(1, self.steps // 10)


def sync(device: str) -> None:
    """Waits for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class _Clock:
    """Wall time minus the time spent validating: tokens/s counts training only."""

    def __init__(self, device: str):
        self.device, self.excluded = device, 0.0
        self.start = time.perf_counter()

    def train_time(self) -> float:
        return time.perf_counter() - self.excluded

    @contextlib.contextmanager
    def excluding(self):
        sync(self.device)  # the queued training work is training time
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t0


def _ranks_agree(model: torch.nn.Module, group, val_loss: float | None) -> dict[str, bool]:
    """Whether every rank holds the same FP8 scales and amax histories (rows 1+: row 0 holds
    this rank's amaxes of the microbatch in flight), the same parameters (compared through
    per-tensor float64 sums) and the same final validation loss."""
    import torch.distributed as dist

    fp8, fingerprint = [], []
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if meta is not None:
            for block in (meta.fwd, meta.bwd):
                fp8 += [block.scales().flatten(), block.history()[1:].flatten()]
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # FSDP2: all of it
        fingerprint.append(p.double().sum().reshape(1))
    checks = [("fp8_state", fp8), ("parameters", fingerprint)]
    if val_loss is not None:
        checks.append(("val_loss", [torch.tensor([val_loss], dtype=torch.float64,
                                                 device=fingerprint[0].device)]))  # fmt: skip
    out = {}
    for name, parts in checks:
        mine = torch.cat(parts) if parts else torch.zeros(1, device=next(model.parameters()).device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        out[name] = all(torch.equal(g, gathered[0]) for g in gathered)
    return out


def _log_interval(run: Run, opts: RunOptions, log, pending, val_losses: dict, last_step: int,
                  elapsed: float, rate: float, tokens_per_step: int) -> list[float]:  # fmt: skip
    """Materialises the losses of the steps since the last log point (the one host sync per
    interval) and writes their CSV rows. Returns the losses."""
    values = torch.stack(pending).tolist()
    pending.clear()
    if log is not None:
        for i, value in enumerate(values):
            step = last_step + i + 1
            log.write(dict(step=step, loss=value, val_loss=val_losses.get(step, ""),
                           lr=run.lr_at(step - 1, opts.steps), tokens=step * tokens_per_step,
                           elapsed_s=round(elapsed, 3), tokens_per_s=round(rate, 1)))  # fmt: skip
    return values


def _train_steps(run: Run, opts: RunOptions, steps: int, tokens_per_step: int, val,
                 stop: StopAtStepBoundary, replicas: ReplicaCheck | None) -> dict:  # fmt: skip
    """Steps `run` up to `steps` (after Ctrl-C: to the end of the step in flight, with a group
    to the next log point), validating every opts.every steps and at the end, logging every
    opts.log_every steps (and comparing the replicas' digests there). Returns the losses and the
    training seconds behind tokens/s."""
    first = run.step
    steady_from = first + max(1, (steps - first) // 10)
    log = MetricsLog(opts.out / f"{run.spec.name}.csv") if opts.is_main else None
    progress = Progress(opts.steps, run.spec.name, opts.is_main)
    losses, pending, val_losses, steady_rates = [], [], {}, []
    clock = _Clock(run.spec.device)
    t_last = clock.train_time()
    t_steady, last_step = None, first
    stopped = False
    while run.step < steps and not stopped:
        if run.fp8_stats is not None:
            run.fp8_stats.enable(run.step % opts.fp8_stats == 0)
        pending.append(run.train_step(opts.steps))
        if replicas is not None:
            replicas.record(run.step)
        if run.step == steady_from:
            sync(run.spec.device)
            t_steady = clock.train_time()
        at_log = run.step % opts.log_every == 0 or run.step == steps
        # Ranks agree at log points (a host sync already); one process stops at once.
        stopped = stop.agreed(opts.group, run.spec.device) if at_log else (
            opts.group is None and stop.requested)  # fmt: skip
        if val is not None and not stopped and (run.step % opts.every == 0 or run.step == steps):
            if run.fp8_stats is not None:  # validation casts are not training's
                run.fp8_stats.enable(False)
            with clock.excluding():
                val_losses[run.step] = validation_loss(run, val)
        if not at_log and not stopped:
            continue
        if replicas is not None:
            replicas.check()
        sync(run.spec.device)  # the interval's GPU work, not only its enqueueing (log points sync)
        now = clock.train_time()
        rate = tokens_per_step * (run.step - last_step) / (now - t_last)
        if last_step >= steady_from:  # the repeats behind tokens/s's spread
            steady_rates.append(rate)
        elapsed = time.perf_counter() - clock.start
        losses += _log_interval(run, opts, log, pending, val_losses, last_step, elapsed, rate,
                                tokens_per_step)  # fmt: skip
        shown = {"loss": f"{losses[-1]:.4f}"}
        if val_losses:
            shown["val"] = f"{val_losses[max(val_losses)]:.4f}"
        progress.update(run.step, **shown, tok_s=f"{rate:,.0f}")
        t_last, last_step = clock.train_time(), run.step
    sync(run.spec.device)
    if log is not None:
        log.close()
    t_end = clock.train_time()
    steady_s = t_end - t_steady if t_steady is not None else 0.0
    return dict(losses=losses, val_losses=[[s, v] for s, v in sorted(val_losses.items())],
                train_s=time.perf_counter() - clock.start, eval_s=clock.excluded,
                steady_s=steady_s, steady_steps=max(0, run.step - steady_from),
                steady_rates=steady_rates,
                interrupted=stopped)  # fmt: skip


def _resume(run: Run, opts: RunOptions) -> None:
    """Loads opts.resume into `run` after checking that it continues this run."""
    state = load_checkpoint(opts.resume)
    notes = check_resumable(state, run_settings(run.spec), opts.steps, opts.data.describe())
    for note in notes if opts.is_main else ():
        print(f"note: {note}")
    if run.spec.shard:  # the manifest, and this rank's file beside it
        state = load_sharded_run(state, opts.resume, run, opts.group)
    run.load_state_dict(state)


def _write_fp8_stats(run: Run, opts: RunOptions) -> dict | None:
    """<out>/<run>_fp8_stats.csv and .png when the run recorded them; their paths and a digest
    per role (graphfp8.numerics.role_digest)."""
    if run.fp8_stats is None or not opts.is_main:
        return None
    name = run.spec.name
    rows = run.fp8_stats.rows()
    csv_path = run.fp8_stats.write_csv(opts.out / f"{name}_fp8_stats.csv")
    png = plot_stats(rows, opts.out / f"{name}_fp8_stats.png")
    return {"csv": str(csv_path), "png": str(png) if png else None, "every": opts.fp8_stats,
            "roles": role_digest(rows)}  # fmt: skip


def _train_and_save(run: Run, opts: RunOptions, steps: int, tokens_per_step: int, val,
                    replicas: ReplicaCheck | None):  # fmt: skip
    """_train_steps, then the checkpoint (--save) and the FP8 statistics' files (--fp8-stats):
    also after a Ctrl-C at a step boundary. Returns (_train_steps' dict, _write_fp8_stats')."""
    try:
        with StopAtStepBoundary() as stop:
            t = _train_steps(run, opts, steps, tokens_per_step, val, stop, replicas)
            path = None
            if opts.save is not None and run.spec.shard:  # every rank writes its own file
                path = save_sharded_run(run, opts.save, opts.steps, opts.data.describe(),
                                        opts.group)  # fmt: skip
            elif opts.save is not None and opts.is_main:
                path = save_checkpoint(run, opts.save, opts.steps, opts.data.describe())
            if path is not None and opts.is_main:
                print(f"saved {path} (step {run.step} of {opts.steps})")
    finally:
        if run.fp8_stats is not None:
            run.fp8_stats.close()
    return t, _write_fp8_stats(run, opts)


def _start_replica_check(run: Run, opts: RunOptions) -> ReplicaCheck | None:
    """--check-replicas with a group: the check, with the starting weights (step 0 or resumed)
    recorded."""
    if not (opts.check_replicas and opts.group is not None):
        return None
    replicas = ReplicaCheck(run.model, opts.group)
    replicas.record(run.step)
    return replicas


def _replicas_summary(replicas: ReplicaCheck | None, losses: list[float], group) -> dict | None:
    """--check-replicas: the check's summary and every rank's losses (a collective)."""
    if replicas is None:
        return None

    every = gather_objects(losses, group)
    return {**replicas.summary(), "losses_per_rank": every}


def train_run(spec: RunSpec, opts: RunOptions) -> dict:
    """Trains `spec` for opts.steps optimizer steps (counting from a resumed step; ending early
    at opts.stop_at), validating on opts.data's validation set.

    Returns:
        {"name", "losses" (per step), "final_loss", "val_losses" ([step, loss] pairs),
        "final_val_loss", "tokens_per_s" (steady state: after the first tenth of the steps,
        capture and validation excluded), "capture_s", "parameters", "peak_reserved_bytes"
        (torch.cuda.max_memory_reserved over the run; None on the CPU), "memory_per_rank"
        (training/report.py rank_memory: each rank's peak and bytes per parameter), ...}.
    """
    if spec.device.startswith("cuda"):
        # peak_reserved_bytes is this run's: an earlier run's cached blocks (--compare runs
        # share the process) would count as reserved otherwise.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run = Run(spec, opts.data, opts.group)
    if opts.resume is not None:
        _resume(run, opts)
    first, steps = run.step, min(opts.steps, opts.stop_at or opts.steps)
    if first >= steps:
        raise CheckpointError(f"the checkpoint is at step {first}: --steps {opts.steps} (stop "
                              f"at {steps}) leaves nothing to train")  # fmt: skip
    cfg = spec.model
    val = None
    if opts.data.has_validation:
        val = opts.data.val_batches(cfg.seq_len, cfg.batch, opts.val_batches, run.rank, run.world)
    if opts.fp8_stats and spec.precision == "fp8":  # before the capture: its kernels join it
        run.fp8_stats = (BlockStats if spec.scaling == "blockwise" else FP8Stats)(run.model)
    t0 = time.perf_counter()
    run.prepare()
    sync(spec.device)
    capture_s = time.perf_counter() - t0
    tokens_per_step = spec.tokens_per_microbatch * spec.microbatches * opts.world_size
    replicas = _start_replica_check(run, opts)
    t, stats_files = _train_and_save(run, opts, steps, tokens_per_step, val, replicas)
    steady_tokens = tokens_per_step * t["steady_steps"]
    tokens_per_s = steady_tokens / t["steady_s"] if steady_tokens and t["steady_s"] > 0 else None
    final_val = t["val_losses"][-1][1] if t["val_losses"] else None
    agree = _ranks_agree(run.model, opts.group, final_val) if opts.group is not None else None
    memory = rank_memory(run, opts.group)
    return {
        "name": spec.name,
        "precision": spec.precision,
        "graphs": spec.graphs,
        "fp8_attention": spec.fp8_attention,  # packed batches excepted (bf16 attention)
        "recompute": spec.recompute,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "parameters": count_parameters(run.model),
        "first_step": first,
        "steps": run.step,
        "interrupted": t["interrupted"],
        "losses": t["losses"],
        "final_loss": final_loss(t["losses"]),
        "val_losses": t["val_losses"],
        "final_val_loss": final_val,
        "capture_s": round(capture_s, 3),
        "train_s": round(t["train_s"], 3),
        "eval_s": round(t["eval_s"], 3),
        "tokens_per_s": tokens_per_s,
        **speed_fields(spec, tokens_per_s, t["steady_rates"], opts.world_size),
        "peak_reserved_bytes": (
            torch.cuda.max_memory_reserved() if spec.device.startswith("cuda") else None
        ),  # fmt: skip
        "ranks_agree": agree,
        "replicas": _replicas_summary(replicas, t["losses"], opts.group),
        "memory_per_rank": memory,
        "fp8_stats": stats_files,
        "model_state": run.model.state_dict() if opts.keep_state else None,
    }
