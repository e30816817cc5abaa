"""Batches staged ahead (`graphfp8-train --stage-batches`): the next step's microbatches read,
pinned and copied to the device on a side stream while the current step runs.

Without it each microbatch is read from the token stream and copied (from pageable memory) when
the step reaches it, and the GPU waits for the host in between (the idle time of issue 41's 100m
profile). Staged, a step takes what the previous step left on the device, and the host prepares
the next step's while the GPU works. The batches are the same tensors (Dataset.train_batch is a
pure function of the step), so a staged run gives the same bits (tests/training/test_staging.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["BatchStager"]

HostBatch = tuple[torch.Tensor, ...]  # a microbatch on the CPU: (tokens[, segments])


class BatchStager:
    """One step's microbatches on the device, staged one step ahead when `ahead` is True.

    Args:
        read: read(step, microbatch) -> a microbatch's CPU tensors ((b, S + 1) int64 each).
        microbatches: per optimizer step.
        device: where the step runs.
        ahead: stage the next step's microbatches at `stage(step)`; False: `take` reads and copies
            each microbatch when asked, as the loop always did.
    """

    def __init__(self, read: Callable[[int, int], HostBatch], microbatches: int, device,
                 ahead: bool = False):  # fmt: skip
        self.read, self.microbatches, self.ahead = read, microbatches, ahead
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda and ahead else None
        self._staged: tuple[int, list[HostBatch], object] | None = None  # (step, batches, event)

    def take(self, step: int):
        """Yields step `step`'s microbatches on the device, in order: the staged ones when
        stage(step) ran before (their copies ordered before the current stream's next work),
        else each read and copied now."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] != step:
            for mb in range(self.microbatches):
                yield tuple(t.to(self.device, non_blocking=True) for t in self.read(step, mb))
            return
        _, batches, event = staged
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for batch in batches:
                for t in batch:  # allocated on the side stream, used and freed on this one
                    t.record_stream(current)
        yield from batches

    def stage(self, step: int, total: int | None = None) -> None:
        """Reads step `step`'s microbatches now and starts their copies (on the GPU on a side
        stream, from pinned memory); a no-op unless staging ahead, or when `step` is past the
        run's `total` steps."""
        if not self.ahead or (total is not None and step >= total):
            return
        host = [self.read(step, mb) for mb in range(self.microbatches)]
        if self._stream is None:
            self._staged = (step, [tuple(t.to(self.device) for t in b) for b in host], None)
            return
        with torch.cuda.stream(self._stream):
            batches = [tuple(t.pin_memory().to(self.device, non_blocking=True) for t in b)
                       for b in host]  # fmt: skip
            event = torch.cuda.Event()
            event.record(self._stream)
        self._staged = (step, batches, event)
