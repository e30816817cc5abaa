"""The main gradients a captured backward adds into (fuse_wgrad_accumulation), as the replay guard
sees them: each replay is refused once a weight's main_grad is no longer the tensor the graph
writes, and the weights' `grad_added_to_main_grad` flags are set after each backward replay, as
an eager backward sets them (docs/after-capture.md; docs/fp8.md, "Weight-gradient accumulation").

Cost per replay: one identity test per such weight (`w.main_grad is` the captured tensor); the
captured tensors' storage is watched with the other tensors (graphs/replay_guard.py).
"""

from __future__ import annotations

import torch

__all__ = ["MainGradGuard"]


class MainGradGuard:
    """The weights (with names) whose gradient the capture added into their main_grad.

    Args:
        name: what raises, for messages.
        weights: (name, weight) pairs; each weight's main_grad now is what the graph writes.
        recapture: what the user does to capture again (the end of every message).
    """

    def __init__(self, name: str, weights, recapture: str) -> None:
        self.name, self.recapture = name, recapture
        self.names = [n for n, _ in weights]
        self.weights = [w for _, w in weights]
        self.grads: list[torch.Tensor] = [w.main_grad for w in self.weights]
        self.layouts = [_layout(g) for g in self.grads]

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, main_grad) of the captured tensors, whose storage the replay guard watches."""
        return [(f"{n} main_grad", g) for n, g in zip(self.names, self.grads, strict=True)]

    def check(self) -> None:
        """Raises RuntimeError, before anything runs, when a weight's main_grad is another tensor
        than the one the graph writes (a new tensor of the same storage, shape, dtype and
        strides is the same memory: it is taken)."""
        for i, (w, g) in enumerate(zip(self.weights, self.grads, strict=True)):
            now = getattr(w, "main_grad", None)
            if now is g:
                continue
            if isinstance(now, torch.Tensor) and _layout(now) == self.layouts[i]:
                self.grads[i] = now
                continue
            raise RuntimeError(
                f"{self.name}: the main_grad of {self.names[i]} was replaced after capture "
                f"({_what(now, self.layouts[i])}; e.g. `w.main_grad = torch.zeros_like(w)`); "
                "the graphs still add the weight gradient into the old tensor. Zero it in place "
                f"(`w.main_grad.zero_()`) or copy new values into it, or {self.recapture}"
            )

    def set_added(self) -> None:
        """After a backward replay: TE's `grad_added_to_main_grad` set to True on the weights
        that carry it, as the eager backward sets it (graphfp8/fp8/main_grad.py, added)."""
        for w in self.weights:
            if hasattr(w, "grad_added_to_main_grad"):
                w.grad_added_to_main_grad = True


def _layout(g: torch.Tensor) -> tuple:
    """What the graph's writes into a main_grad depend on: its memory and how it is laid out."""
    return g.data_ptr(), g.shape, g.stride(), g.dtype, g.device


def _what(now, was: tuple) -> str:
    """How a weight's main_grad differs from the captured one's layout (`was`), for messages."""
    if now is None:
        return "it was deleted"
    if not isinstance(now, torch.Tensor):
        return f"it is now a {type(now).__name__}"
    where = "another address" if now.data_ptr() != was[0] else "the same address"
    return f"it is now a {now.dtype} tensor of shape {tuple(now.shape)} at {where}"
