"""Module dicts that count their writes, so that a replay can tell in O(1) whether any captured
module changed since capture (docs/after-capture.md).

At capture, every captured module's `_parameters`, `_buffers`, `_modules` and hook dicts are
swapped for subclasses whose mutating methods bump one process-wide counter (`CHANGES`). Every
way torch changes a module goes through them: `module.weight = ...` and load_state_dict(
assign=True) write `_parameters`, `module.to()` writes `_buffers`, `model.layer = other` writes
`_modules`, register_forward_hook writes `_forward_hooks`. A guard remembers the counter it saw
and looks closer (graphs/replay_guard.py) only when it moved. Reads are plain dict reads.

The counter only grows (reset_state() leaves it alone: a guard that saw value v must never see
v again after a change). The swapped dicts stay after reset(): they behave as the dicts they
replaced, and pickle as dicts of this module's classes.
"""

from __future__ import annotations

from collections import OrderedDict

from graphfp8 import global_state

__all__ = ["CHANGES", "WatchedDict", "WatchedOrderedDict", "watch_modules"]


class _Counter:
    """A process-wide count of writes to watched dicts."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


CHANGES = _Counter()
global_state.register_kept(
    "module dict write counter (graphs/watch.py CHANGES)",
    "a guard that saw value v must never see v again after a change",
)

_MUTATORS = ("__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update",
             "setdefault")  # fmt: skip


def _counting(base: type, name: str):
    method = getattr(base, name)

    def counted(self, *args, **kwargs):
        CHANGES.value += 1
        return method(self, *args, **kwargs)

    counted.__name__ = name
    return counted


class WatchedDict(dict):
    """A dict whose writes bump CHANGES (a module's `_parameters`, `_buffers`, `_modules`)."""

    __slots__ = ("__weakref__",)


class WatchedOrderedDict(OrderedDict):
    """An OrderedDict whose writes bump CHANGES (a module's hook dicts; their RemovableHandles
    hold weak references to them)."""


for _name in _MUTATORS:
    setattr(WatchedDict, _name, _counting(dict, _name))
    setattr(WatchedOrderedDict, _name, _counting(OrderedDict, _name))
WatchedOrderedDict.move_to_end = _counting(OrderedDict, "move_to_end")

# The dicts of a module that a captured graph depends on: what it reads and what would run Python.
MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_WATCHED = ("_parameters", "_buffers", "_modules", *MODULE_HOOKS)
_COUNTING = {dict: WatchedDict, OrderedDict: WatchedOrderedDict}


def watch_modules(modules) -> None:
    """Swaps the dicts of each module for counting ones (a module watched already keeps its)."""
    for m in modules:
        state = vars(m)
        for name in _WATCHED:
            counting = _COUNTING.get(type(state.get(name)))
            if counting is not None:
                state[name] = counting(state[name])
