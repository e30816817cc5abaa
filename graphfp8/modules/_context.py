"""The one place modules read the FP8 context (graphfp8/fp8/context.py): whether a call runs in
FP8 and under which recipe, and for an FP8 forward its slots, the updates the scale schedule
places around it and the GEMM configs that carry them. Nothing here writes into the context.

    ctx = context.current()
    eager:    forward update of the module's forward arena, once per region (scale_schedule.py);
              its backward arena's update handed to the configs for the end of the backward
              pass; weight casts decided by is_first_microbatch (weight_cache.py, EAGER)
    capture:  the module's arenas recorded (ctx.recorder); no update (the graphs place them);
              every weight cast recorded, the graph's device flag deciding (GraphCasts)
    frozen:   an eval-mode call (module.eval()): current scales, no amax, no update, and its
              weight casts (is_first_microbatch None or True) into scratch workspaces, each
              weight scaled from itself, so the module's weight cache stays as training left
              it; False reuses that cache
    recompute the forward of an activation-checkpointed region records its slots
              (ctx.recompute); its recompute casts with the saved scales, no amax, no update,
              the cached FP8 weights (fp8/recompute.py)
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.fp8 import context, scaling
from graphfp8.fp8.current import own_scale
from graphfp8.fp8.recipe import Recipe, is_blockwise, is_current_scaling
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.fp8.slots import FwdRole, slot_index
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.fp8.weight_cache import BlockWeight, WeightCache, block_workspace
from graphfp8.modules._functional import GemmConfig

# The FP8 layers' base class (modules/base.py) imports this module: `module` below is an FP8Module,
# annotated as the nn.Module it is so that the two stay a one-way import.

__all__ = ["FrozenSlots", "blockwise_recipe", "blockwise_weights", "fp8_enabled", "fp8_recipe",
           "fp8_slots", "fp8_state", "frozen_call", "gemm_configs", "in_fp8_region",
           "init_group"]  # fmt: skip


def fp8_enabled() -> bool:
    """Whether graphfp8 modules run in FP8 now (dynamo guards on it: modules/_compile.py)."""
    return context.current().enabled


def in_fp8_region() -> bool:
    """Whether an fp8_autocast region (enabled or not) or a capture is open: a model carrying
    its recipe (modules/carry.py) then leaves the choice to it."""
    return context.current() is not context.OFF


def init_group() -> scaling.InitGroup | None:
    """The init group modules take their slots from now (fp8/scaling.py), None outside any
    region."""
    return context.current().init_group


def fp8_recipe() -> Recipe | None:
    """The recipe FP8 modules run under now, or None when FP8 is off."""
    ctx = context.current()
    return ctx.recipe if ctx.enabled else None


def blockwise_recipe() -> Recipe | None:
    """The Float8BlockScaling that FP8 modules run under now, or None (FP8 off or another
    recipe): their GEMMs then quantize per tile and block, with no slots (modules/_blockwise)."""
    ctx = context.current()
    return ctx.recipe if ctx.enabled and is_blockwise(ctx.recipe) else None


class FrozenSlots:
    """A SlotBlock whose casts read its scales but fold their amaxes into the arena's sink: an
    FP8 call that leaves the delayed-scaling state as it was (a frozen call). Given the call's
    weights (an evaluation cast), each weight's slot scales from that weight alone (own_scale):
    a weight changed since training last cast it is not cast with the old weight's scale."""

    def __init__(self, block: scaling.SlotBlock, weights=()):
        self.block, self.arena, self.start = block, block.arena, block.start
        self._own = {}
        for g, w in enumerate(weights):
            if not isinstance(w, Float8Tensor):  # an FP8 primary weight carries its own scale
                i = slot_index(FwdRole.WEIGHT, g)
                self._own[i] = own_scale(block, i, w)

    def scale(self, i: int) -> torch.Tensor:
        own = self._own.get(i)
        return self.block.scale(i) if own is None else own

    def amax(self, i: int) -> torch.Tensor:
        return self.arena.amax_sink

    def scales(self) -> torch.Tensor:
        return self.block.scales()


def _frozen_call(module: nn.Module, ctx: context.FP8Context) -> bool:
    """An eager eval-mode call (an evaluation forward, generate(), a validation loop, between
    or after training microbatches; a graphed module's eager fallback too): it runs with the
    current scales and leaves the delayed-scaling state and the weight cache alone (no amax
    recorded, no update, no cached weight written), so training continues exactly as if it had
    not run (docs/fp8.md, "Evaluation")."""
    return (
        not module.training
        and not ctx.capturing
        and not is_current_scaling(ctx.recipe)  # no state carries from cast to cast
    )


def frozen_call(module: nn.Module) -> bool:
    """Whether an FP8 call of `module` now is frozen (_frozen_call): FP8 attention asks it, as the
    GEMMs' configs do, so that an eval-mode call leaves the attention's slots alone too."""
    return _frozen_call(module, context.current())


def fp8_state(module: nn.Module, device, frozen: bool = False,
              ctx: context.FP8Context | None = None) -> tuple:  # fmt: skip
    """(FP8Meta, ...): the module's slots for an FP8 forward under the context's recipe, and the
    (backward arena, group) whose update must run at the end of the backward pass (eager), or
    None (in a capture, which records the arenas and places both updates itself; or a `frozen`
    call, which updates nothing). Eager mode runs the forward update point here."""
    ctx = ctx or context.current()
    meta = module.fp8_init(ctx.recipe, device, ctx.init_group)
    if ctx.recorder is not None:
        ctx.recorder.record(meta.fwd.arena, meta.bwd.arena)
        return meta, None
    if frozen:
        return meta, None
    SCHEDULE.forward_in_region(meta.fwd.arena, ctx.region, ctx.group)
    return meta, (meta.bwd.arena, ctx.group)


def fp8_slots(module: nn.Module, device, frozen: bool = False,
              ctx: context.FP8Context | None = None, weights=()) -> tuple:  # fmt: skip
    """(forward slots, backward slots, backward update) of an FP8 forward of `module`: fp8_state's,
    the frozen call's FrozenSlots (`weights` each scaled from itself), or a recompute's
    ReplaySlots (no update; fp8/recompute.py)."""
    ctx = ctx or context.current()
    region = ctx.recompute
    if region is not None and region.replaying:
        meta = module.fp8_init(ctx.recipe, device, ctx.init_group)
        return region.replay_slots(meta.fwd, type(module).__name__), meta.bwd, None
    meta, bwd_update = fp8_state(module, device, frozen, ctx)
    if region is not None:
        region.used(meta.fwd)
    if frozen:
        return FrozenSlots(meta.fwd, weights), FrozenSlots(meta.bwd), bwd_update
    return meta.fwd, meta.bwd, bwd_update


def _weight_call(module: nn.Module, ctx: context.FP8Context, is_first_microbatch: bool | None,
                 kind: str) -> tuple[bool, bool]:  # fmt: skip
    """(replaying, evaluating) of this forward's weight casts: a recompute replaying its forward,
    an evaluation call (eval mode, not capturing, is_first_microbatch not False). A training call
    claims the weight cache for `kind`'s casts ("per-tensor" or "blockwise"); the cache's rule
    is checked before any FP8 state changes (fp8/weight_cache.py)."""
    replaying = ctx.recompute is not None and ctx.recompute.replaying
    evaluating = (not module.training and not ctx.capturing and not replaying
                  and is_first_microbatch is not False)  # fmt: skip
    if not (replaying or evaluating):
        module.weight_cache.use_kind(kind)
    if not replaying:
        ctx.weight_cache.check(module.weight_cache, is_first_microbatch, type(module).__name__)
    return replaying, evaluating


def gemm_configs(
    module: nn.Module,
    weights: list[tuple[str, torch.Tensor]],
    is_first_microbatch: bool | None,
    fp8_output: bool,
) -> list[GemmConfig]:
    """One GemmConfig per (workspace key, weight (N, K)) for this FP8 forward of `module`."""
    ctx = context.current()
    owner, cache = type(module).__name__, module.weight_cache
    # An evaluation cast: into workspaces of its own, each weight scaled from itself (frozen),
    # the cache left as training left it.
    replaying, evaluating = _weight_call(module, ctx, is_first_microbatch, "per-tensor")
    frozen = _frozen_call(module, ctx)
    own = [w for _, w in weights] if evaluating else ()
    fwd, bwd, bwd_update = fp8_slots(module, weights[0][1].device, frozen, ctx, own)
    fp8_dtype = fwd.arena.fp8_dtype
    if evaluating:
        cache = WeightCache()
    workspaces = [cache.workspace(key, w, fp8_dtype, module.cache_weight_transpose, owner)
                  for key, w in weights]  # fmt: skip
    cast, flag = evaluating, None  # a recompute reads the FP8 weights its forward cast (or cached)
    if not (replaying or evaluating):
        cast, flag = ctx.weight_cache.casts(cache, is_first_microbatch, owner)
    # An FP8 primary weight rewritten since its last transpose needs a new one. An FSDP2-gathered
    # FP8 weight's transpose is left to the backward (weight_t builds it when stale): its forward
    # GEMM reads the data alone, and a reshard after forward frees the transpose before the
    # backward's all-gather again (docs/sharding.md, "FSDP2 inside the graphs").
    gathered = [getattr(ws, "_fsdp_gathered", False) for ws in workspaces]
    casts = [not g and (cast or (ws is w and not ws._transpose_valid))
             for g, ws, (_, w) in zip(gathered, workspaces, weights, strict=True)]  # fmt: skip
    flags = [None if g else flag for g in gathered]
    last = len(weights) - 1
    configs = []
    for g, ws in enumerate(workspaces):
        configs.append(GemmConfig(fwd, bwd, g, ws, casts[g], flags[g],
                                  fp8_output=fp8_output and g == last,
                                  backward_update=bwd_update))  # fmt: skip
    return configs


def blockwise_weights(module: nn.Module, weights: list[tuple[str, torch.Tensor]],
                      is_first_microbatch: bool | None) -> list[BlockWeight | None]:  # fmt: skip
    """One BlockWeight per (workspace key, weight (N, K)) for a Float8BlockScaling forward of
    `module`: its cached 128x128 blocks, quantized or reused by the same rule and policies as
    gemm_configs' per-tensor casts (fp8/weight_cache.py). An evaluation call (eval mode,
    is_first_microbatch not False) gets None per weight: each GEMM quantizes its weight afresh,
    leaving the cache as training left it."""
    ctx = context.current()
    owner, cache = type(module).__name__, module.weight_cache
    replaying, evaluating = _weight_call(module, ctx, is_first_microbatch, "blockwise")
    if evaluating:
        return [None] * len(weights)
    p2 = ctx.recipe.power_2_scale
    with_t = module.cache_weight_transpose
    workspaces = [block_workspace(cache, key, w, p2, with_t) for key, w in weights]
    cast, flag = False, None  # a recompute reads the blocks its forward quantized (or reused)
    if not replaying:
        cast, flag = ctx.weight_cache.casts(cache, is_first_microbatch, owner)
    return [BlockWeight(ws, cast, flag) for ws in workspaces]
