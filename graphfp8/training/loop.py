"""Drives one Run through its steps: timing, logging, progress and checkpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphfp8.training.model import count_parameters
from graphfp8.training.report import MetricsLog, Progress, final_loss
from graphfp8.training.run import Run, RunSpec

__all__ = ["RunOptions", "sync", "train_run"]


@dataclass
class RunOptions:
    steps: int  # the run's length: the LR schedule spans it
    out: Path
    log_every: int = 10
    save: Path | None = None
    resume: Path | None = None
    group: object = None
    world_size: int = 1
    is_main: bool = True
    keep_state: bool = False  # return the final model state_dict (tests)
    stop_at: int | None = None  # end early after this step (e.g. save, resume later)
    corpus: torch.Tensor = field(default=None, repr=False)


def sync(device: str) -> None:
    """Waits for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _ranks_agree(model: torch.nn.Module, group) -> dict[str, bool]:
    """Whether every rank holds the same FP8 scales and amax histories (rows 1+: row 0 holds
    this rank's amaxes of the microbatch in flight) and the same parameters (compared through
    per-tensor float64 sums)."""
    import torch.distributed as dist

    fp8, fingerprint = [], []
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if meta is not None:
            for block in (meta.fwd, meta.bwd):
                fp8 += [block.scales().flatten(), block.history()[1:].flatten()]
    for p in model.parameters():
        fingerprint.append(p.detach().double().sum().reshape(1))
    out = {}
    for name, parts in (("fp8_state", fp8), ("parameters", fingerprint)):
        mine = torch.cat(parts) if parts else torch.zeros(1, device=next(model.parameters()).device)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        out[name] = all(torch.equal(g, gathered[0]) for g in gathered)
    return out


def _log_interval(
    run: Run,
    opts: RunOptions,
    log,
    pending,
    last_step: int,
    t_start: float,
    t_last: float,
    tokens_per_step: int,
) -> tuple[list[float], float]:
    """Materialises the losses of the steps since the last log point (the one host sync per
    interval), writes their CSV rows. Returns (losses, tokens/s over the interval)."""
    values = torch.stack(pending).tolist()
    pending.clear()
    now = time.perf_counter()
    rate = tokens_per_step * (run.step - last_step) / (now - t_last)
    if log is not None:
        for i, value in enumerate(values):
            step = last_step + i + 1
            log.write(dict(step=step, loss=value, lr=run.lr_at(step - 1, opts.steps),
                           tokens=step * tokens_per_step, elapsed_s=round(now - t_start, 3),
                           tokens_per_s=round(rate, 1)))  # fmt: skip
    return values, rate


def _train_steps(run: Run, opts: RunOptions, steps: int, tokens_per_step: int) -> dict:
    """Steps `run` up to `steps`, logging every opts.log_every steps. Returns the losses and the
    timestamps that the tokens/s figures come from."""
    first = run.step
    steady_from = first + max(1, (steps - first) // 10)
    log = MetricsLog(opts.out / f"{run.spec.name}.csv") if opts.is_main else None
    progress = Progress(steps - first, run.spec.name, opts.is_main)
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    t_start = t_last = time.perf_counter()
    t_steady, last_step = None, first
    while run.step < steps:
        pending.append(run.train_step(opts.steps))
        if run.step == steady_from:
            sync(run.spec.device)
            t_steady = time.perf_counter()
        if run.step % opts.log_every and run.step != steps:
            continue
        values, rate = _log_interval(run, opts, log, pending, last_step, t_start, t_last,
                                     tokens_per_step)  # fmt: skip
        losses += values
        progress.update(run.step - first, loss=f"{values[-1]:.4f}", tok_s=f"{rate:,.0f}")
        t_last, last_step = time.perf_counter(), run.step
    sync(run.spec.device)
    if log is not None:
        log.close()
    return dict(losses=losses, t_start=t_start, t_steady=t_steady, t_end=time.perf_counter(),
                steady_steps=steps - steady_from)  # fmt: skip


def train_run(spec: RunSpec, opts: RunOptions) -> dict:
    """Trains `spec` for opts.steps optimizer steps (counting from a resumed step; ending early
    at opts.stop_at).

    Returns:
        {"name", "losses" (per step), "final_loss", "tokens_per_s" (steady state: after the
        first tenth of the steps, capture excluded), "capture_s", "parameters",
        "peak_reserved_bytes" (torch.cuda.max_memory_reserved over the run; None on the CPU),
        ...}.
    """
    if spec.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()  # peak_reserved_bytes is this run's
    run = Run(spec, opts.corpus, opts.group)
    if opts.resume is not None:
        run.load_state_dict(torch.load(opts.resume, map_location=spec.device, weights_only=False))
    first, steps = run.step, min(opts.steps, opts.stop_at or opts.steps)
    if first >= steps:
        raise ValueError(f"the checkpoint is at step {first}: --steps {opts.steps} (stop at "
                         f"{steps}) leaves nothing to train")  # fmt: skip
    t0 = time.perf_counter()
    run.prepare()
    sync(spec.device)
    capture_s = time.perf_counter() - t0
    tokens_per_step = spec.tokens_per_microbatch * spec.microbatches * opts.world_size
    t = _train_steps(run, opts, steps, tokens_per_step)
    if opts.save is not None and opts.is_main:
        opts.save.parent.mkdir(parents=True, exist_ok=True)
        torch.save(run.state_dict(), opts.save)
    steady_tokens = tokens_per_step * t["steady_steps"]
    steady_s = t["t_end"] - t["t_steady"] if t["t_steady"] is not None else 0.0
    return {
        "name": spec.name,
        "precision": spec.precision,
        "graphs": spec.graphs,
        "parameters": count_parameters(run.model),
        "first_step": first,
        "steps": steps,
        "losses": t["losses"],
        "final_loss": final_loss(t["losses"]),
        "capture_s": round(capture_s, 3),
        "train_s": round(t["t_end"] - t["t_start"], 3),
        "tokens_per_s": steady_tokens / steady_s if steady_tokens and steady_s > 0 else None,
        "peak_reserved_bytes": (
            torch.cuda.max_memory_reserved() if spec.device.startswith("cuda") else None
        ),  # fmt: skip
        "ranks_agree": _ranks_agree(run.model, opts.group) if opts.group is not None else None,
        "model_state": run.model.state_dict() if opts.keep_state else None,
    }
