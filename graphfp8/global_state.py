"""Every piece of process-wide state graphfp8 keeps, in one registry with one reset
(graphfp8.reset_state(); docs/architecture.md, "Global state").

Each owner registers its state when it is imported: a name, how to reset it, and how to tell
that it is as in a fresh process (tests/test_global_state.py checks every entry). Counters that
must only grow are listed as kept, with the reason: resetting them would break what they
guarantee.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["BASE", "FP8", "GRAPHS", "Entry", "entries", "kept", "register", "register_kept",
           "reset_all"]  # fmt: skip

# The layer an entry belongs to: reset_all() resets the top layer first (live captures hold
# graphs that may hold cuDNN plans and arenas, so they go before the caches and arenas).
BASE, FP8, GRAPHS = 0, 1, 2


@dataclass(frozen=True)
class Entry:
    """One piece of global state."""

    name: str
    reset: Callable[[], None]
    is_fresh: Callable[[], bool]
    layer: int


_ENTRIES: dict[str, Entry] = {}
_KEPT: dict[str, str] = {}


def register(name: str, reset: Callable[[], None], is_fresh: Callable[[], bool], *,
             layer: int) -> None:  # fmt: skip
    """Adds a piece of global state (registering a name again replaces it: module reloads)."""
    _ENTRIES[name] = Entry(name, reset, is_fresh, layer)


def register_kept(name: str, why: str) -> None:
    """Records process state that reset_all() deliberately leaves alone, and why."""
    _KEPT[name] = why


def entries() -> list[Entry]:
    """Every registered entry, in the order reset_all() resets them."""
    return sorted(_ENTRIES.values(), key=lambda e: -e.layer)


def kept() -> dict[str, str]:
    """{name: why} of the state that is never reset."""
    return dict(_KEPT)


def reset_all() -> None:
    """Returns every registered piece of state to that of a fresh process."""
    for entry in entries():
        entry.reset()
