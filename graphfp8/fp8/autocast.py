"""fp8_autocast: pushes one FP8 context (graphfp8/fp8/context.py) per region, and
graphfp8.reset_state().

Each outermost enabled region gets a new region number (the forward scale updates run once per
region: graphfp8/fp8/scale_schedule.py) and a new init group for the arenas of modules that get
their slots in it (graphfp8/fp8/scaling.py). Inside a capture neither happens: the capture's
context says where the updates go, and a region there only switches FP8 on or off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

from graphfp8 import global_state
from graphfp8.fp8 import arena_check, context, observe, scaling
from graphfp8.fp8.recipe import DelayedScaling, Recipe, check_recipe, is_blockwise

__all__ = ["autocast", "fp8_autocast", "reset_state"]

# Numbers outermost enabled fp8_autocast regions. Never reset: arenas remember the region that
# last updated them, so a reused number would skip an update.
_REGIONS = itertools.count(1)
# The observer lives in fp8/observe.py, below this module; registered here, where fp8_autocast
# is, so that observe.py stays free of the registry.
global_state.register("numerics observer (fp8/observe.py)", lambda: observe.install(None),
                      lambda: observe.observer() is None, layer=global_state.FP8)  # fmt: skip
global_state.register("recipes agreed per fp8_group (fp8/arena_check.py AGREED_RECIPES)",
                      arena_check.AGREED_RECIPES.clear, lambda: not arena_check.AGREED_RECIPES,
                      layer=global_state.FP8)  # fmt: skip
global_state.register_kept(
    "fp8_autocast region counter (fp8/autocast.py _REGIONS)",
    "arenas remember the region that last updated them: a reused number would skip an update",
)


def reset_state() -> None:
    """Returns graphfp8's global state to that of a fresh process (every entry of
    graphfp8/global_state.py): no fp8_autocast region or capture in progress, no queued backward
    update, no registered arena (modules keep theirs), no numerics observer
    (graphfp8.fp8.observe), no live capture (each is reset(): its graphs freed, its modules'
    eager forward back), no cached cuDNN graph or capture stream, NVTX ranges as the
    environment says. Tests call it between cases. A CUDA graph captured outside graphfp8
    around FP8 attention must be dropped first: it may replay kernels of the cuDNN plans this
    frees."""
    global_state.reset_all()


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None, fp8_group=None, *,
                 fp8_recipe: Recipe | None = None):  # fmt: skip
    """Runs graphfp8 modules inside the region in FP8 (delayed or current scaling).

    Each outermost enabled region is one scale-update step for the forward arenas it uses, as
    one forward replay of a graph is: enter one region per microbatch. Nested regions belong to
    the outermost one.

    Args:
        enabled: False runs the modules in their parameter dtype.
        recipe: a DelayedScaling or Float8CurrentScaling; DelayedScaling() when None.
        fp8_group: torch.distributed group whose ranks MAX-reduce their amaxes before every
            scale update (the forward arena's in this region, the backward arena's at the end of
            its backward pass); see graphfp8.distributed.
        fp8_recipe: `recipe` under TransformerEngine's name (as TransformerEngine, Lightning and
            accelerate spell it); giving both raises.
    """
    if fp8_recipe is not None:
        if recipe is not None:
            raise TypeError("fp8_autocast: give recipe or fp8_recipe (the same argument), not both")
        recipe = fp8_recipe
    if recipe is None:
        recipe = DelayedScaling()
    check_recipe(recipe, "fp8_autocast")
    outer = context.current()
    # A capture keeps (and puts back after warmup) the state of its own recipe's arenas; a
    # blockwise region has none, so it may nest in any capture (docs/fp8.md, "Blockwise scaling").
    other = recipe != outer.recipe and not is_blockwise(recipe)
    if outer.capturing and enabled and outer.recipe is not None and other:
        raise RuntimeError(
            "fp8_autocast inside a graph capture must use the recipe given to "
            f"make_graphed_callables ({outer.recipe}) or a Float8BlockScaling, got {recipe}"
        )
    region, init_group = outer.region, outer.init_group
    if enabled and not outer.enabled and not outer.capturing:
        arena_check.check_recipe_agrees(recipe, fp8_group)  # before any FP8 collective
        region, init_group = next(_REGIONS), scaling.InitGroup()
    ctx = dataclasses.replace(outer, enabled=bool(enabled), recipe=recipe, group=fp8_group,
                              region=region, init_group=init_group)  # fmt: skip
    with context.pushed(ctx):
        yield


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
             amax_reduction_group=None):  # fmt: skip
    """fp8_autocast under TransformerEngine 2.x's name and argument names (its positional order
    too): `recipe`, `amax_reduction_group` (fp8_autocast's fp8_group). calibrating=True
    (TransformerEngine's statistics-only mode) is not supported and raises."""
    if calibrating:
        raise NotImplementedError(
            "autocast: calibrating=True (collecting FP8 statistics without FP8 compute) is not "
            "supported by graphfp8; graphfp8.numerics.FP8Stats records the casts of an FP8 run"
        )
    return fp8_autocast(enabled, recipe, amax_reduction_group)
