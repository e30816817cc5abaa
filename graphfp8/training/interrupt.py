"""Ctrl-C during graphfp8-train: the run stops at the next optimizer-step boundary (a checkpoint
of a half-done step - a graph replay or an optimizer step cut off in the middle - would not
resume), so the checkpoint (--save) and summary.json hold what finished. A second Ctrl-C aborts
at once, writing nothing. Data-parallel ranks agree on the step to stop at (at log points)."""

from __future__ import annotations

import signal
import sys
import threading

import torch

__all__ = ["StopAtStepBoundary"]


class StopAtStepBoundary:
    """A context manager that turns the first SIGINT into a request the training loop reads.

    Attributes:
        requested: whether Ctrl-C was pressed (on this rank).
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopAtStepBoundary:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ngraphfp8-train: Ctrl-C: stopping after this step, then writing what finished "
              "(Ctrl-C again aborts without writing)", file=sys.stderr, flush=True)  # fmt: skip

    def agreed(self, group, device: str) -> bool:
        """Whether any rank of `group` asked to stop (a collective: call it on every rank at
        the same step); this rank's request without a group."""
        if group is None:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag.item())
