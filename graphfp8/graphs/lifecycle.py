"""A capture's life: the graphs of one make_graphed_callables call (CapturedGraphs: schedule, FP8
settings, reset()), which modules have their forward replaced by graphs (so that capturing one
again, or a model containing one, or deep-copying one, raises a clear error), and undoing a
capture that failed halfway. Also where graphs/ reads the FP8 context after capture: a replay
checks the fp8_autocast region it is called in (check_fp8_region, check_outside_fp8_region).

A submodule of a graphed module keeps its eager forward and may be captured on its own. The live
captures are global state: graphfp8.reset_state() resets every one of them (graphfp8/
global_state.py).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from graphfp8 import global_state
from graphfp8.fp8 import context
from graphfp8.graphs.schedule import Layout, Schedule

__all__ = ["CapturedGraphs", "check_outside_fp8_region", "live_owner", "refuse_deepcopy",
           "undone_on_failure"]  # fmt: skip

# Every module whose forward replays a live capture -> a weak reference to its CapturedGraphs.
# Weak both ways: the graphs refer to the module (its forward is theirs), so a strong value would
# keep a dropped model alive.
_CAPTURED: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
# Every capture whose graphs are alive (weakly: a dropped graphed callable frees its capture).
_LIVE: weakref.WeakSet[CapturedGraphs] = weakref.WeakSet()


def _reset_live() -> None:
    for graphs in list(_LIVE):
        graphs.reset()
    _CAPTURED.clear()


global_state.register(
    "live captures (graphs/lifecycle.py)", _reset_live, lambda: not _LIVE and not _CAPTURED,
    layer=global_state.GRAPHS,
)  # fmt: skip


class CapturedGraphs:
    """The graphs of one make_graphed_callables call, and what its runners share: held once.

    Attributes:
        runners: one GraphedRunner per graph pair, in schedule.Layout order (register()).
        schedule: the replay-order check.
        fp8_enabled, recipe, group: the FP8 settings the graphs were captured with (any FP8,
            the first FP8 callable's recipe); recipes: each callable's recipe (None: no FP8).
        flag: the is_first_microbatch device flag (graphfp8/fp8/weight_cache.py DeviceFlag).
        autocast: the torch.autocast state of the capture (graphs/torch_autocast.py).
        closed: reset() has run.
    """

    def __init__(self, layout: Layout, names: list[str], options, device, flag,
                 autocast):  # fmt: skip
        self.runners: list = []
        self.schedule = Schedule(layout, names)
        self.fp8_enabled, self.recipe = options.fp8_enabled, options.recipe
        self.recipes = options.recipes
        self.group = options.fp8_group
        self.device, self.flag, self.autocast = device, flag, autocast
        self.closed = False
        self.modules: list[weakref.ref] = []
        self._undo: list = []  # what reset() puts back on the user's modules

    def check_fp8_region(self, contract) -> None:
        """Inside fp8_autocast (not a capture), a callable with FP8 modules (its runner's
        CallContract) must have been captured with the region's FP8 settings: the graph cannot
        follow another recipe, group or enabled flag, and eager calls in that region would."""
        ctx, recipe = context.current(), contract.recipe
        if ctx.recipe is None or ctx.capturing or not contract.uses_fp8:
            return
        if not ctx.enabled and recipe is None:
            return
        if ctx.enabled and recipe is not None:
            if ctx.recipe == recipe and ctx.group is self.group:
                return
            what = (
                f"fp8_recipe={recipe}, called inside fp8_autocast(recipe={ctx.recipe})"
                if ctx.recipe != recipe
                else "another fp8_group than the fp8_autocast region it is called in"
            )
        else:
            what = (
                f"fp8_enabled={recipe is not None}, called inside fp8_autocast(enabled="
                f"{ctx.enabled})"
            )
        raise RuntimeError(
            f"{contract.name}: captured with {what}; the graph carries its own FP8 settings. "
            "Call it outside that region, or capture it with the region's settings"
        )

    def register(self, runners, funcs, undos, skippable=()) -> None:
        """Takes the capture's runners, and marks the modules among `funcs` (one per runner)
        whose forward now replays these graphs; reset() runs their `undos` (None where nothing
        was replaced). skippable: the runners a microbatch may leave out (graphs/schedule.py)."""
        self.runners = list(runners)
        self.schedule.skippable = frozenset(skippable)
        pairs = [(f, undo) for f, undo in zip(funcs, undos, strict=True) if undo is not None]
        self.modules = [weakref.ref(f) for f, _ in pairs]
        for f, _ in pairs:
            _CAPTURED[f] = weakref.ref(self)
        self._undo = [undo for _, undo in pairs]
        _LIVE.add(self)

    def reset(self) -> None:
        """Frees every graph and static buffer of this capture, so its memory pool returns to
        the allocator once the outputs still held are dropped, and gives the modules their
        eager forward back. The callables of one capture go together: their scale updates and
        memory are shared. Later calls of a graphed function raise."""
        if self.closed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for runner in self.runners:
            runner.pair.release()
        for undo in self._undo:
            undo()
        for ref in self.modules:
            m = ref()
            if m is not None and _owner(m) is self:
                del _CAPTURED[m]
        self.closed = True
        _LIVE.discard(self)


def check_outside_fp8_region(name: str) -> None:
    """A microbatch or step graph is called outside fp8_autocast: it carries its own FP8
    settings (graphed callables compare theirs: CapturedGraphs.check_fp8_region)."""
    ctx = context.current()
    if ctx.enabled and not ctx.capturing:
        raise RuntimeError(
            f"{name}: the graph carries its own FP8 state and scale updates; call it "
            "outside fp8_autocast (its fp8_enabled / fp8_recipe / fp8_group are fixed at "
            "capture)"
        )


def _owner(module: nn.Module) -> CapturedGraphs | None:
    ref = _CAPTURED.get(module)
    return None if ref is None else ref()


def live_owner(module: nn.Module) -> CapturedGraphs | None:
    """The live capture whose graphs `module`'s forward replays, or None (capturing it again
    is refused: graphs/capture_checks.py)."""
    owner = _owner(module)
    return owner if owner is not None and not owner.closed else None


def refuse_deepcopy(module: nn.Module):
    """A graphed module's __deepcopy__: the copy would share the original's graphs."""

    def __deepcopy__(memo):
        raise RuntimeError(
            f"cannot deepcopy a graphed {type(module).__name__}: its forward replays graphs that "
            "hold the original's tensors, so a copy would silently train the original. Deep-copy "
            "the module before make_graphed_callables, or call reset() on it first"
        )

    return __deepcopy__


@contextlib.contextmanager
def undone_on_failure(fp8_modules, samples, callables):
    """Puts the modules back as they were when the capture raises: their FP8 slots and weight
    workspaces, the `.grad` buffers it created, attributes it set on the callables. (FP8 values
    and RNG are restored by the phases themselves, the frozen arenas by the CaptureSession.)

    Args:
        fp8_modules: the FP8 modules of the capture.
        samples: what is captured (graphs/callable_phases.Sample): their `params`, read again
            on failure (with the parameters found by then).
        callables: the callables given.
    """
    fp8_saved = [(m, m.fp8_snapshot()) for m in fp8_modules]
    attrs = [(c, set(vars(c))) for c in callables if isinstance(c, nn.Module)]
    had_buffer = {id(p) for r in samples for p in r.params if hasattr(p, "_graphfp8_grad")}
    try:
        yield
    except BaseException:
        for m, snap in fp8_saved:
            m.restore_fp8(snap)
        for p in {id(p): p for r in samples for p in r.params}.values():
            if id(p) not in had_buffer and hasattr(p, "_graphfp8_grad"):
                del p._graphfp8_grad
        for c, keys in attrs:
            for key in set(vars(c)) - keys:
                delattr(c, key)
        raise
