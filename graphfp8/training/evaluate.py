"""Validation loss of a run: eager, no grad, the run's precision, FP8 state left as it was.

The whole evaluation is one fp8_autocast region in eval mode: every call is frozen
(graphfp8/modules/_context.py; docs/fp8.md, "The carried recipe: weight casts and evaluation"),
so every validation batch runs with the scales the last training microbatch left, each weight cast
with a scale of its own into workspaces of its own, and no amax history, scale or cached FP8
weight changes; the arenas are also restored bit for bit afterwards. Training continues exactly
as if no evaluation had run. Graphed blocks run their eager forward in eval mode (the graph's
rule for another training mode).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from graphfp8.fp8.autocast import fp8_autocast
from graphfp8.training.data import IGNORE, split_windows
from graphfp8.training.run import Run

__all__ = ["fp8_state_preserved", "validation_loss"]


@contextlib.contextmanager
def fp8_state_preserved(model: nn.Module):
    """Restores the amax histories and scales of every FP8 arena that `model` uses on exit."""
    arenas = {}
    for module in model.modules():
        meta = getattr(module, "fp8_meta", None)
        if meta is not None:
            arenas.update({id(b.arena): b.arena for b in (meta.fwd, meta.bwd)})
    snapshots = [(arena, arena.snapshot()) for arena in arenas.values()]
    try:
        yield
    finally:
        for arena, snap in snapshots:
            arena.restore_(snap)


def validation_loss(run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross entropy per token over the validation windows of every rank.

    Args:
        run: the run whose model is evaluated (its optimizer and step are not touched).
        batches: this rank's (tokens (b, S + 1) int64, weights (b,) float32[, segments (b, S +
            1)]) tuples; windows of weight 0 are padding (training/data.py). With segments a
            window's loss is its mean over the tokens predicted (not a document's first).

    Returns:
        The loss, identical on every rank (sums reduced over run.group).
    """
    model, device = run.model, run.spec.device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (weighted loss sum, weight)
    was_training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            fp8_state_preserved(model),
            fp8_autocast(enabled=run.fp8, recipe=run.recipe, fp8_group=run.group),
        ):
            for tokens, weights, *segments in batches:
                tokens = tokens.to(device, non_blocking=True)
                segments = [s.to(device, non_blocking=True) for s in segments]
                inputs, targets, seg = split_windows(tokens, *segments)
                hidden = model.hidden(inputs, segment_ids=seg)
                losses = model.token_losses(hidden, targets)
                if seg is None:
                    per_window = losses.mean(dim=1).double()
                else:  # the mean over the tokens predicted
                    counted = (targets != IGNORE).sum(dim=1).clamp(min=1)
                    per_window = (losses.sum(dim=1) / counted).double()
                weights = weights.to(device, torch.float64, non_blocking=True)
                totals[0] += (per_window * weights).sum()
                totals[1] += weights.sum()
    finally:
        model.train(was_training)
    if run.group is not None:
        dist.all_reduce(totals, group=run.group)
    loss_sum, count = totals.tolist()
    return loss_sum / count
