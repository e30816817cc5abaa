"""fp8_autocast and the small global FP8 state that modules and the graph capturer read.

Where the scale updates run (docs/fp8.md): once per fp8_autocast region, each forward arena is
updated before the first cast that uses it (the first FP8 forward of one of its modules in the
region: nothing touches FP8 state between the region's entry and that point, so this is the
region-entry update of docs/fp8.md, restricted to the arenas the region uses); each backward arena
at the end of every backward pass that ran its modules (an autograd engine callback). Inside a
graph capture neither happens implicitly: the capturer records the two updates at the matching
points of its graphs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from graphfp8 import global_state
from graphfp8.fp8 import observe, scaling
from graphfp8.fp8.recipe import DelayedScaling, Recipe, check_recipe

__all__ = [
    "autocast",
    "fp8_autocast",
    "STATE",
    "CaptureState",
    "check_is_first_microbatch",
    "queue_backward_update",
    "reset_state",
]


@dataclass
class CaptureState:
    """Set by graphs/ during warmup and capture: FP8 bookkeeping is recorded into the graphs.

    Attributes:
        weight_cache_flag: (1,) float32 device flag read by the weight cast-transpose kernels
            (1: the cached FP8 weight is valid, the cast writes nothing); None casts weights on
            every replay.
        arenas: the arenas that the captured modules use, filled while warming up.
    """

    weight_cache_flag: torch.Tensor | None
    arenas: dict[int, scaling.Arena] = field(default_factory=dict)


class _State:
    """The process's FP8 state: what the innermost fp8_autocast (or capture) says."""

    def __init__(self) -> None:
        # Counts outermost enabled fp8_autocast regions. Never reset: arenas remember the region
        # that last updated them, so a reused number would skip an update.
        self.region = 0
        self.reset()

    def reset(self) -> None:
        self.enabled = False
        self.recipe: Recipe | None = None
        self.group = None
        self.capture: CaptureState | None = None
        self.queued_backward: dict[int, tuple] = {}

    def is_fresh(self) -> bool:
        return (not self.enabled and self.recipe is None and self.group is None
                and self.capture is None and not self.queued_backward)  # fmt: skip


STATE = _State()
global_state.register("fp8_autocast state (fp8/autocast.py STATE)", STATE.reset, STATE.is_fresh,
                      layer=global_state.FP8)  # fmt: skip
# The observer lives in fp8/observe.py, below this module; registered here, where fp8_autocast's
# state is, so that observe.py stays free of the registry.
global_state.register("numerics observer (fp8/observe.py)", lambda: observe.install(None),
                      lambda: observe.observer() is None, layer=global_state.FP8)  # fmt: skip
global_state.register_kept(
    "fp8_autocast region counter (STATE.region)",
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


def check_is_first_microbatch(is_first_microbatch) -> None:
    """Eager modules and graphed callables take None, True or False, nothing else."""
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(
            f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}"
        )


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
    prev = (STATE.enabled, STATE.recipe, STATE.group)
    capture = STATE.capture
    if capture is not None and enabled and STATE.recipe is not None and recipe != STATE.recipe:
        raise RuntimeError(
            "fp8_autocast inside a graph capture must use the recipe given to "
            f"make_graphed_callables ({STATE.recipe}), got {recipe}"
        )
    if enabled and not prev[0] and capture is None:
        STATE.region += 1
        scaling.new_init_group()
    STATE.enabled, STATE.recipe, STATE.group = bool(enabled), recipe, fp8_group
    try:
        yield
    finally:
        STATE.enabled, STATE.recipe, STATE.group = prev


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


@contextlib.contextmanager
def capture_state(fp8_enabled: bool, recipe: Recipe | None, group, capture: CaptureState):
    """Internal: the FP8 state that warmup and capture run under (no implicit updates)."""
    prev = (STATE.enabled, STATE.recipe, STATE.group, STATE.capture)
    STATE.enabled, STATE.recipe, STATE.group = fp8_enabled, recipe, group
    STATE.capture = capture
    try:
        yield
    finally:
        STATE.enabled, STATE.recipe, STATE.group, STATE.capture = prev


def queue_backward_update(arena: scaling.Arena, group) -> None:
    """Schedules the update of a backward arena for the end of the running backward pass (once
    per pass, however many of its modules ask). Only valid while autograd runs a backward."""
    if id(arena) in STATE.queued_backward:
        return
    if not STATE.queued_backward:
        torch.autograd.Variable._execution_engine.queue_callback(_run_backward_updates)
    STATE.queued_backward[id(arena)] = (arena, group)


def _run_backward_updates() -> None:
    queued = list(STATE.queued_backward.values())
    STATE.queued_backward.clear()
    for arena, group in queued:
        arena.update_(group)
