"""Drives one Run through its steps: timing, logging, progress and checkpoints."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphfp8.training.loop import Run, RunSpec
from graphfp8.training.model import count_parameters
from graphfp8.training.report import MetricsLog, Progress, final_loss

__all__ = ["RunOptions", "train_run"]


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


def _sync(device: str) -> None:
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


def train_run(spec: RunSpec, opts: RunOptions) -> dict:
    """Trains `spec` for opts.steps optimizer steps (counting from a resumed step).

    Returns:
        {"name", "losses" (per step), "final_loss", "tokens_per_s" (steady state: after the
        first tenth of the steps, capture excluded), "capture_s", "parameters", ...}.
    """
    run = Run(spec, opts.corpus, opts.group)
    if opts.resume is not None:
        run.load_state_dict(torch.load(opts.resume, map_location=spec.device, weights_only=False))
    t0 = time.perf_counter()
    run.prepare()
    _sync(spec.device)
    capture_s = time.perf_counter() - t0
    tokens_per_step = spec.tokens_per_microbatch * spec.microbatches * opts.world_size
    first, total = run.step, opts.steps
    steps = min(total, opts.stop_at or total)
    if first >= steps:
        raise ValueError(f"the checkpoint is at step {first}: --steps {total} (stop at {steps}) "
                         "leaves nothing to train")  # fmt: skip
    steady_from = first + max(1, (steps - first) // 10)
    log = MetricsLog(opts.out / f"{spec.name}.csv") if opts.is_main else None
    progress = Progress(steps - first, spec.name, opts.is_main)
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    t_start = t_last = time.perf_counter()
    t_steady, last_step = None, first
    while run.step < steps:
        pending.append(run.train_step(total))
        if run.step == steady_from:
            _sync(spec.device)
            t_steady = time.perf_counter()
        if run.step % opts.log_every and run.step != steps:
            continue
        values = torch.stack(pending).tolist()  # the one host sync per log interval
        pending.clear()
        now = time.perf_counter()
        rate = tokens_per_step * (run.step - last_step) / (now - t_last)
        for i, value in enumerate(values):
            losses.append(value)
            if log is not None:
                step = last_step + i + 1
                log.write(dict(step=step, loss=value, lr=run.lr_at(step - 1, total),
                               tokens=step * tokens_per_step, elapsed_s=round(now - t_start, 3),
                               tokens_per_s=round(rate, 1)))  # fmt: skip
        progress.update(run.step - first, loss=f"{values[-1]:.4f}", tok_s=f"{rate:,.0f}")
        t_last, last_step = now, run.step
    _sync(spec.device)
    t_end = time.perf_counter()
    if log is not None:
        log.close()
    if opts.save is not None and opts.is_main:
        opts.save.parent.mkdir(parents=True, exist_ok=True)
        torch.save(run.state_dict(), opts.save)
    agree = _ranks_agree(run.model, opts.group) if opts.group is not None else None
    steady_tokens = tokens_per_step * (steps - steady_from)
    return {
        "name": spec.name,
        "precision": spec.precision,
        "graphs": spec.graphs,
        "parameters": count_parameters(run.model),
        "first_step": first,
        "steps": steps,
        "losses": losses,
        "final_loss": final_loss(losses) if losses else None,
        "capture_s": round(capture_s, 3),
        "train_s": round(t_end - t_start, 3),
        "tokens_per_s": steady_tokens / (t_end - t_steady) if t_steady and steady_tokens else None,
        "ranks_agree": agree,
        "model_state": run.model.state_dict() if opts.keep_state else None,
    }
