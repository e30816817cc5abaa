"""Activation recompute with the FP8 state exact: torch.utils.checkpoint (non-reentrant) whose
recomputed forward casts as the original did and changes no FP8 state (docs/fp8.md, "Activation
recompute").

    forward      the region runs under the caller's FP8 context with a Region attached: every
                 FP8 call records its forward slot block there (and runs as always: the forward
                 update point, its amaxes, its weight casts); when the region returns, the
                 scales of those blocks are saved (a copy of a few floats per module)
    recompute    inside the backward, under the forward's context with the Region replaying:
                 each FP8 call casts with the saved scales (ReplaySlots), folds its amaxes into
                 a scratch, reuses the cached FP8 weights (no cast), queues no backward
                 update and is not observed; the backward of the original nodes runs as without
                 recompute (its update point once per pass)

So one scale update per step and each amax recorded once, as without recompute, eagerly and in
every graph (the recompute is captured into the backward graph). The saved scales make the
recompute independent of updates that run between a forward and its backward.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.utils.checkpoint

from graphfp8.fp8 import context
from graphfp8.fp8.scaling import ReplaySlots, SlotBlock

__all__ = ["Region", "recompute"]


class Region:
    """One checkpointed call's FP8 bookkeeping: the forward slot blocks its FP8 calls used and
    their scales after its forward; `replaying` in the context of its recompute."""

    def __init__(self, parent: Region | None = None, replaying: bool = False):
        self.parent, self.replaying = parent, replaying
        self.blocks: dict[int, SlotBlock] = {}
        self.saved: dict[int, torch.Tensor] = {}

    def used(self, block: SlotBlock) -> None:
        """An FP8 call of the forward used `block` (also recorded by an enclosing region)."""
        region = self
        while region is not None:
            region.blocks[id(block)] = block
            region = region.parent

    def save_scales(self) -> None:
        """After the forward: the scales its casts used (current scaling: computed by them)."""
        self.saved.clear()  # in place: the recompute's Region shares the dict
        self.saved.update({key: block.scales().clone() for key, block in self.blocks.items()})

    def replay_slots(self, block: SlotBlock, owner: str) -> ReplaySlots:
        """The forward slots a recomputed FP8 call of `owner` casts with."""
        saved = self.saved.get(id(block))
        if saved is None:
            raise RuntimeError(
                f"{owner}: its recomputed forward runs in FP8, but the original forward of this "
                "checkpointed region did not (FP8 switched on or modules changed between a "
                "forward and its backward); a checkpointed region must run the same FP8 "
                "modules when it is recomputed"
            )
        return ReplaySlots(block, saved)

    def replay(self) -> Region:
        """This region as its recompute's context holds it."""
        region = Region(self.parent, replaying=True)
        region.blocks, region.saved = self.blocks, self.saved
        return region


@contextlib.contextmanager
def _forward(ctx: context.FP8Context, region: Region):
    with context.pushed(ctx):
        yield
    region.save_scales()


def _contexts():
    """torch.utils.checkpoint's context_fn: (the forward's context, the recompute's)."""
    ctx = context.current()
    outer = ctx.recompute
    if not ctx.enabled or (outer is not None and outer.replaying):
        # No FP8, or a region nested in one being recomputed (whose saved scales cover it):
        # the recompute runs under exactly the forward's context.
        return contextlib.nullcontext(), context.pushed(ctx)
    region = Region(parent=outer)
    forward_ctx = dataclasses.replace(ctx, recompute=region)
    replay_ctx = dataclasses.replace(ctx, recompute=region.replay())
    return _forward(forward_ctx, region), context.pushed(replay_ctx)


def recompute(function, *args, **kwargs):
    """function(*args, **kwargs) with its activations recomputed in the backward instead of kept
    (torch.utils.checkpoint.checkpoint, use_reentrant=False), its FP8 casts replayed exactly.

    Eagerly and inside every capture entry point: the recompute becomes part of the backward
    graph. The function must draw no random numbers (the RNG state is not preserved: torch's
    copy of the CUDA RNG state cannot run inside a graph capture; graphfp8's layers draw none)
    and must run the same FP8 modules when recomputed.

    Args:
        function: the region, e.g. a TransformerLayer's body.
        args, kwargs: its arguments (tensors and anything else).

    Returns:
        function's output.
    """
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=_contexts, preserve_rng_state=False,
        **kwargs,
    )  # fmt: skip
