"""The capture session: the one skeleton that make_graphed_callables, make_graphed_microbatch and
make_graphed_step run their own bodies in (docs/architecture.md, "Capture").

    with CaptureSession(device, ...) as session:     argument checks done (capture_checks.py)
        session.init_fp8(chunks)                     slots in fresh arenas, checked across ranks
        with session.warmup() as found: ...          side stream, the capture's FP8 context, no
                                                     autocast cache; FP8 state, RNG (and the
                                                     snapshot, when given) put back; `found`
                                                     records the arenas the modules used
        arenas = session.freeze_arenas(found.arenas) checked across ranks, frozen
        points = session.update_points(arenas)       the scale updates the graphs hold
        with session.capture_phase():                FP8 state, RNG, snapshot put back after,
                                                     the snapshot dropped; no garbage collection
            with session.capture_into(graph) as rec:  or autocast cache inside
                points.at_forward(); ...; points.at_backward()
            graph.updates = rec.updates: what each replay reports to the schedule (backends.py)

The FP8 context of warmup and capture (graphfp8/fp8/context.py) is a value the session pushes:
the capture's recipe and group, the weight-cache policy of its graphs and a fresh ArenaRecorder
per recording, whose arenas and updates are the recording's result.

On failure (any exception inside `with session:`) the arenas it froze are unfrozen; what else a
capture changes is the entry point's to undo (graphs/lifecycle.py for the callables).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from graphfp8.fp8 import context, main_grad, scaling
from graphfp8.fp8.context import ArenaRecorder, FP8Context
from graphfp8.fp8.scale_schedule import UpdatePoints
from graphfp8.fp8.weight_cache import GraphCasts, WeightCachePolicy
from graphfp8.graphs.backends import new_graph
from graphfp8.graphs.contexts import (
    autocast_cache_off,
    fp8_and_rng_preserved,
    gc_paused,
    side_stream,
)
from graphfp8.graphs.fp8_init import freeze_arenas, init_fp8_modules
from graphfp8.graphs.options import CaptureOptions
from graphfp8.nvtx_ranges import nvtx_range

__all__ = ["CaptureSession"]


class CaptureSession:
    """One capture's options, weight-cache policy, memory pool and the arenas it froze.

    Args:
        device: the device of every tensor the capture reads.
        options: the entry point's CaptureOptions (graphs/options.py): FP8 settings (recipe
            None without FP8), warmup count, pool (None: a new one on CUDA).
        weight_cache_flag: (1,) float32 device flag the weight casts read while warming up and
            capturing (None: they cast on every replay; the step graph pushes one per
            microbatch: weight_policy()).
        snapshot: an object whose restore() undoes what a warmup or a CPU capture (which runs
            what it records) changed in the model or optimizer; None: nothing to undo. The
            session drops it when capture_phase() ends, whatever the outcome.
    """

    def __init__(self, device: torch.device, options: CaptureOptions, *, weight_cache_flag=None,
                 snapshot=None):  # fmt: skip
        self.device, self.options, self.snapshot = device, options, snapshot
        self.fp8_enabled, self.recipe = options.fp8_enabled, options.recipe
        self.fp8_group, self.pool = options.fp8_group, options.pool
        self.weight_cache = GraphCasts(weight_cache_flag)
        self.frozen: list = []
        self.init_group = scaling.InitGroup()  # where modules first reached in warmup go
        # The weights whose gradient warmup or capture added into their main_grad
        # (fuse_wgrad_accumulation: graphs/main_grad_guard.py), filled while the session is open.
        self.added: dict[int, torch.Tensor] = {}
        self._recording = None

    def __enter__(self) -> CaptureSession:
        self._recording = main_grad.recording()
        self.added = self._recording.__enter__()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self._recording.__exit__(None, None, None)  # the weights' flags put back
        if kind is not None:
            scaling.freeze(self.frozen, False)

    def init_fp8(self, chunks, recipe_of=None) -> None:
        """Allocates the FP8 slots of each chunk's modules (lists of FP8 modules) before warmup,
        in fresh arenas per chunk, and checks them across the ranks of fp8_group.
        recipe_of(module): a module's recipe, or None for none (default: the capture's)."""
        if self.fp8_enabled:
            self.init_group = init_fp8_modules(chunks, recipe_of or (lambda m: self.recipe),
                                               self.device, self.fp8_group)  # fmt: skip

    @contextlib.contextmanager
    def recording(self, callable_index: int | None = None):
        """Runs the block under the capture's FP8 context (graphs/ records the scale updates,
        nothing runs them implicitly); yields its ArenaRecorder: the arenas the block's modules
        used and the updates it recorded. callable_index: the block runs that callable of
        make_graphed_callables, under its own FP8 setting (options.recipes)."""
        recipe = self.recipe if callable_index is None else self.options.recipes[callable_index]
        ctx = FP8Context(enabled=recipe is not None, recipe=recipe, group=self.fp8_group,
                         region=context.current().region, weight_cache=self.weight_cache,
                         recorder=ArenaRecorder(), init_group=self.init_group)  # fmt: skip
        with context.pushed(ctx):
            yield ctx.recorder

    def weight_policy(self, policy: WeightCachePolicy):
        """Inside a recording: the block's weight casts follow `policy` (the step graph's
        per-microbatch StaticCasts, graphfp8/fp8/weight_cache.py)."""
        ctx = context.current()
        return context.pushed(dataclasses.replace(ctx, weight_cache=policy))

    @contextlib.contextmanager
    def warmup(self):
        """Eager iterations on the capture stream, their FP8, RNG and snapshot effects undone;
        yields the ArenaRecorder of the whole warmup."""
        try:
            with fp8_and_rng_preserved(self.options.all_recipes, self.device), nvtx_range("warmup"):
                with side_stream(self.device), self.recording() as found, autocast_cache_off():
                    yield found
        finally:
            if self.snapshot is not None:
                self.snapshot.restore()

    def freeze_arenas(self, arenas: dict) -> list:
        """The arenas warmup reached ({id: arena}), checked across ranks and frozen; returns
        them in creation order."""
        arenas = sorted(arenas.values(), key=lambda a: a.serial)
        self.frozen += freeze_arenas(arenas, self.fp8_group)
        return arenas

    def update_points(self, arenas) -> UpdatePoints:
        """The scale updates a graph over `arenas` (those its modules used) records: split by
        direction, reduced over fp8_group."""
        return UpdatePoints.of(arenas, self.fp8_group)

    @contextlib.contextmanager
    def capture_phase(self):
        """The block that captures the graphs. The CPU tape runs what it records, hence the
        snapshot. No garbage collection inside: a collected graph of an earlier capture frees
        its memory pool, which a CUDA capture in progress does not allow (seen on the H200 as
        cudaErrorStreamCaptureInvalidated)."""
        if self.pool is None and self.device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        try:
            recipes = self.options.all_recipes
            with fp8_and_rng_preserved(recipes, self.device), gc_paused(self.device):
                with nvtx_range("capture"), autocast_cache_off():
                    yield
        finally:
            if self.snapshot is not None:
                self.snapshot.restore()
            # The capture was the snapshot's last use: the graph must not keep a copy of the
            # model alive (docs/sharding.md, "Memory planner").
            self.snapshot = None

    def new_graph(self):
        """An empty graph of the session's backend (CUDA graph or CPU tape)."""
        return new_graph(self.device)

    @contextlib.contextmanager
    def capture_into(self, graph, callable_index: int | None = None):
        """Captures the block into `graph` under the capture's FP8 context (that callable's:
        recording()); yields the recording's ArenaRecorder. The graph keeps the scale updates it
        recorded and reports them to the schedule at each replay (graphs/backends.py)."""
        with self.recording(callable_index) as rec, graph.capture(self.pool):
            yield rec
        graph.updates = tuple(rec.updates)
