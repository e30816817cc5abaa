"""When the FP8 arenas update: the two update points, for eager modules and for captures.

    forward point   eager: each forward arena once per outermost fp8_autocast region, before
                    the first cast that uses it (the region's first FP8 forward of one of its
                    modules: nothing touches FP8 state between the region's entry and that point,
                    so this is docs/fp8.md's region-entry update, restricted to the arenas the
                    region uses)
                    graphs: at the start of a unit's first forward graph (graphed callables), of
                    every microbatch (microbatch and step graphs), for all its forward arenas
    backward point  eager: at the end of every backward pass that ran modules of the arena (an
                    autograd engine callback, once per pass however many modules ask)
                    graphs: at the end of a unit's last backward graph, of every microbatch

Every update is `Arena.update_(group)`: the MAX all-reduce of the amaxes over the group, then
the fused kernel (nothing under current scaling, whose casts update their own slots). Eager
modules call forward_in_region() and after_backward(); captures call UpdatePoints.forward() /
backward() inside the graph being captured, which records the updates in it.

The log: inside `with SCHEDULE.logged() as log:` every update that runs appends (point, arena)
to `log`. A graph records at capture which updates it holds (UpdatePoints puts them in the
capture's ArenaRecorder) and each replay reports them (replayed()), so an eager training step and
its graphed callables, microbatch or step graph give the same log (tests/test_scale_schedule.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from graphfp8 import global_state
from graphfp8.fp8 import context
from graphfp8.fp8.scaling import BACKWARD, FORWARD, Arena

__all__ = ["SCHEDULE", "ScaleSchedule", "UpdatePoints"]


class ScaleSchedule:
    """The process's update points: the queued eager backward updates and the open log."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.queued: dict[int, tuple[Arena, object]] = {}
        self.log: list[tuple[str, Arena]] | None = None

    def is_fresh(self) -> bool:
        return not self.queued and self.log is None

    # Eager ------------------------------------------------------------------------------------

    def forward_in_region(self, arena: Arena, region: int, group) -> None:
        """Eager forward point: updates `arena` unless region `region` already did."""
        if arena.updated_in != region:
            arena.updated_in = region
            self._run(FORWARD, (arena,), group)

    def after_backward(self, update: tuple[Arena, object] | None) -> None:
        """Eager backward point: schedules the update of `update` = (backward arena, group) for
        the end of the running backward pass (once per pass); None does nothing (a capture or a
        frozen call). Only valid while autograd runs a backward."""
        if update is None or id(update[0]) in self.queued:
            return
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._run_queued)
        self.queued[id(update[0])] = update

    def _run_queued(self) -> None:
        queued = list(self.queued.values())
        self.queued.clear()
        for arena, group in queued:
            self._run(BACKWARD, (arena,), group)

    # Graphs -----------------------------------------------------------------------------------

    def replayed(self, updates: tuple) -> None:
        """A graph replay ran the updates its capture recorded: logs them."""
        if self.log is not None:
            self.log.extend(updates)

    # Both -------------------------------------------------------------------------------------

    def _run(self, point: str, arenas, group) -> None:
        for arena in arenas:
            arena.update_(group)
        entries = [(point, a) for a in arenas]
        ctx = context.current()
        if ctx.recorder is not None:  # inside a capture: the graph holds these updates
            ctx.recorder.updates.extend(entries)
        elif self.log is not None:
            self.log.extend(entries)

    @contextlib.contextmanager
    def logged(self):
        """Yields a list that collects (point, arena) for every update run in the block (by an
        eager module or a graph replay), in order."""
        outer, self.log = self.log, []
        try:
            yield self.log
        finally:
            self.log = outer


SCHEDULE = ScaleSchedule()
global_state.register("scale schedule: queued backward updates, log (fp8/scale_schedule.py)",
                      SCHEDULE.reset, SCHEDULE.is_fresh, layer=global_state.FP8)  # fmt: skip


@dataclass(frozen=True)
class UpdatePoints:
    """The updates one capture records: its forward and backward arenas (in creation order) and
    the group that reduces their amaxes. NONE (warmup) records nothing."""

    forward: tuple[Arena, ...] = ()
    backward: tuple[Arena, ...] = ()
    group: object = None

    @classmethod
    def of(cls, arenas, group) -> UpdatePoints:
        """The arenas split by direction."""
        arenas = sorted(arenas, key=lambda a: a.serial)
        return cls(tuple(a for a in arenas if a.direction == FORWARD),
                   tuple(a for a in arenas if a.direction == BACKWARD), group)  # fmt: skip

    def at_forward(self) -> None:
        """The forward point: updates the forward arenas (recorded by the graph in capture)."""
        SCHEDULE._run(FORWARD, self.forward, self.group)

    def at_backward(self) -> None:
        """The backward point: updates the backward arenas."""
        SCHEDULE._run(BACKWARD, self.backward, self.group)


NONE = UpdatePoints()
