"""The capture session: the one skeleton that make_graphed_callables, make_graphed_microbatch and
make_graphed_step run their own bodies in (docs/architecture.md, "Capture").

    with CaptureSession(device, ...) as session:     argument checks done (capture_checks.py)
        session.init_fp8(chunks)                     slots in fresh arenas, checked across ranks
        with session.warmup(): ...                   side stream, FP8 capture state, no autocast
                                                     cache; FP8 state, RNG (and the snapshot,
                                                     when given) put back
        session.freeze_arenas()                      the arenas warmup reached: checked, frozen
        with session.capture_phase():                FP8 state, RNG, snapshot put back after; no
            with session.recording(), graph.capture(session.pool):  garbage collection or
                                                     autocast cache inside
                ...

On failure (any exception inside `with session:`) the arenas it froze are unfrozen; what else a
capture changes is the entry point's to undo (graphs/lifecycle.py for the callables).
"""

from __future__ import annotations

import contextlib

import torch

from graphfp8.fp8.autocast import CaptureState, capture_state
from graphfp8.graphs.backends import new_graph
from graphfp8.graphs.contexts import (
    autocast_cache_off,
    fp8_and_rng_preserved,
    gc_paused,
    side_stream,
)
from graphfp8.graphs.fp8_init import freeze_arenas, init_fp8_modules
from graphfp8.profiling import nvtx_range

__all__ = ["CaptureSession"]


class CaptureSession:
    """One capture's FP8 settings, capture state, memory pool and the arenas it froze.

    Args:
        device: the device of every tensor the capture reads.
        fp8_enabled, recipe, fp8_group: the FP8 settings the graphs are captured with (recipe
            None without FP8).
        weight_cache_flag: (1,) float32 device flag the weight casts read while warming up and
            capturing (None: they cast on every replay; the step graph sets one per microbatch
            through `self.capture.weight_cache_flag`).
        pool: a memory pool handle to share, or None for a new one (CUDA).
        snapshot: an object whose restore() undoes what a warmup or a CPU capture (which runs
            what it records) changed in the model or optimizer; None: nothing to undo.
    """

    def __init__(self, device: torch.device, *, fp8_enabled: bool, recipe, fp8_group,
                 weight_cache_flag=None, pool=None, snapshot=None):  # fmt: skip
        self.device, self.fp8_enabled, self.recipe = device, fp8_enabled, recipe
        self.fp8_group, self.snapshot = fp8_group, snapshot
        self.capture = CaptureState(weight_cache_flag=weight_cache_flag)
        self.pool = pool
        self.frozen: list = []

    def __enter__(self) -> CaptureSession:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            for arena in self.frozen:
                arena.frozen = False

    def init_fp8(self, chunks) -> None:
        """Allocates the FP8 slots of each chunk's modules (lists of FP8 modules) before warmup,
        in fresh arenas per chunk, and checks them across the ranks of fp8_group."""
        if self.fp8_enabled:
            init_fp8_modules(chunks, self.recipe, self.device, self.fp8_group)

    def recording(self):
        """The FP8 state that warmup and capture run under: graphs/ records the scale updates,
        nothing runs them implicitly."""
        return capture_state(self.fp8_enabled, self.recipe, self.fp8_group, self.capture)

    @contextlib.contextmanager
    def warmup(self):
        """Eager iterations on the capture stream; their FP8, RNG and snapshot effects undone."""
        try:
            with fp8_and_rng_preserved(self.recipe, self.device), nvtx_range("warmup"):
                with side_stream(self.device), self.recording(), autocast_cache_off():
                    yield
        finally:
            if self.snapshot is not None:
                self.snapshot.restore()

    def freeze_arenas(self) -> list:
        """The arenas warmup reached (capture.arenas), checked across ranks and frozen, in
        creation order."""
        arenas = sorted(self.capture.arenas.values(), key=lambda a: a.serial)
        self.frozen += freeze_arenas(arenas, self.fp8_group)
        return arenas

    @contextlib.contextmanager
    def capture_phase(self):
        """The block that captures the graphs. The CPU tape runs what it records, hence the
        snapshot. No garbage collection inside: a collected graph of an earlier capture frees
        its memory pool, which a CUDA capture in progress does not allow (seen on the H200 as
        cudaErrorStreamCaptureInvalidated)."""
        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        try:
            with fp8_and_rng_preserved(self.recipe, self.device), gc_paused(self.device):
                with nvtx_range("capture"), autocast_cache_off():
                    yield
        finally:
            if self.snapshot is not None:
                self.snapshot.restore()

    def new_graph(self):
        """An empty graph of the session's backend (CUDA graph or CPU tape)."""
        return new_graph(self.device)
