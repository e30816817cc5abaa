"""The one observation point of every FP8 cast, for the numerics report (graphfp8.numerics).

Each cast site of the layers calls `observe_cast` right after its cast with the slot it cast
into and the high-precision tensor it quantized (or a function that recomputes it, for fused
kernels that never write it). With no observer installed - the default - that is one attribute
test per cast; graphfp8.numerics installs one while it records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from graphfp8.fp8.scaling import SlotBlock

__all__ = ["Observer", "install", "observe_cast", "observer"]


class Observer(Protocol):
    def cast(self, block: SlotBlock, i: int, role: str, hp: torch.Tensor) -> None:
        """Called after a cast of `hp` into slot i of `block`, under `role` ("input", ...)."""


_OBSERVER: Observer | None = None


def observer() -> Observer | None:
    """The installed observer, or None."""
    return _OBSERVER


def install(obs: Observer | None) -> Observer | None:
    """Installs `obs` (None: none) and returns the previous observer."""
    global _OBSERVER
    previous, _OBSERVER = _OBSERVER, obs
    return previous


def observe_cast(
    block: SlotBlock, i: int, role: str, hp: torch.Tensor | Callable[[], torch.Tensor]
) -> None:
    """Reports a cast into slot i of `block` to the observer, if one is installed.

    Args:
        block: the module's slot block of the cast's direction.
        i: the slot's index in the block.
        role: the slot's role name ("input", "weight", "output", "grad_output", "q", ...).
        hp: the high-precision tensor that was cast, or a function returning it (called only
            when an observer is installed).
    """
    obs = _OBSERVER
    if obs is not None:
        obs.cast(block, i, role, hp() if callable(hp) else hp)
