"""Schedules: in which order a capture records its graphs, and the check that replays follow it.

All graphs of one make_graphed_callables call share one memory pool and are captured in one
order. A graph captured later may reuse memory that an earlier capture released (temporaries, or
the activations a backward consumed), so replays are only safe in the captured order; and since
each unit's FP8 scale updates sit in its first forward and last backward graph, only that order
equals eager. Any other replay raises, naming the expected and the actual call.

Units and order (TransformerEngine's convention for pipeline schedules): the callables are the
layers of `num_chunks` model chunks, chunk-major, the same number of layers per chunk; `order`
lists chunk ids: +c is the forward of chunk c (1-based) for its next microbatch, -c its backward,
and each chunk appears num_microbatches times each way. sample_args holds one entry per (chunk,
microbatch, layer), chunk-major, and so do the returned callables: one graph pair each, with its
own static buffers, kept until its backward has run. Without `order` the callables are the layers
of one chunk run for one microbatch, order [1, -1]: forwards in turn, then backwards in reverse.

A unit is one (chunk, microbatch): its forward runs its layers' forward graphs in order, the
first one opening with the forward scale update of the arenas those layers use (as one eager
fp8_autocast region per forward would); its backward runs their backward graphs in reverse, the
last one closing with the backward update (as the end of an eager backward pass does).

Without `order`, a microbatch may skip callables after the first (a model that leaves a layer
out): their forward and backward events are passed over, as long as their FP8 arenas are the
first callable's (so the scale updates the first and last graphs run are what eager mode runs)
and no backward that is still pending lies in between. What a skipped graph would have written
is not read by the graphs that do run (they copy their inputs in), so skipping equals eager.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

__all__ = ["Layout", "Schedule", "ScheduleError", "Unit"]


class ScheduleError(RuntimeError):
    """A replay out of the captured order."""


@dataclass
class Unit:
    """One (chunk, microbatch): the runner indices of its layers, in layer order."""

    chunk: int
    microbatch: int
    runners: list[int]


class Layout:
    """Which callable and which unit each runner (graph pair) belongs to, and the capture order.

    Attributes:
        num_chunks, num_microbatches, num_layers: the schedule's shape (layers per chunk).
        order: the order as given, or [1, -1].
        units: {(chunk, microbatch): Unit}, 0-based.
        steps: ("forward" | "backward", Unit) in capture and replay order.
        callable_of: runner index -> callable index.
    """

    def __init__(self, num_callables: int, num_samples: int, order=None):
        self.explicit = order is not None
        if order is None:
            order = [1, -1]
            chunks, mbs = 1, 1
        else:
            order, chunks, mbs = _check_order(order)
        if num_callables % chunks:
            raise ValueError(
                f"make_graphed_callables: {num_callables} callables cannot be split into the "
                f"{chunks} model chunks that order names (the same number of layers per chunk)"
            )
        layers = num_callables // chunks
        if num_samples != chunks * mbs * layers:
            raise ValueError(
                f"make_graphed_callables: order has {chunks} chunks x {mbs} microbatches and the "
                f"callables {layers} layers per chunk, so sample_args needs {chunks * mbs * layers}"
                f" entries (chunk-major, then microbatch, then layer), got {num_samples}"
            )
        self.order, self.num_chunks, self.num_microbatches = order, chunks, mbs
        self.num_layers = layers
        self.units = {
            (c, k): Unit(c, k, [(c * mbs + k) * layers + ll for ll in range(layers)])
            for c in range(chunks)
            for k in range(mbs)
        }
        self.callable_of = [
            (j // (mbs * layers)) * layers + j % layers for j in range(chunks * mbs * layers)
        ]
        seen = {}
        self.steps = []
        for entry in order:
            c = abs(entry) - 1
            k = seen.get(entry, 0)
            seen[entry] = k + 1
            self.steps.append(("forward" if entry > 0 else "backward", self.units[(c, k)]))

    def describe(self, j: int) -> str:
        """'chunk 1, microbatch 2, layer 0' (1-based chunk, as in order) for runner j."""
        if not self.explicit:
            return ""
        mbs, layers = self.num_microbatches, self.num_layers
        c, k, ll = j // (mbs * layers), (j // layers) % mbs, j % layers
        return f"chunk {c + 1}, microbatch {k}, layer {ll}"


def _check_order(order) -> tuple[list[int], int, int]:
    if not isinstance(order, (list, tuple)) or not order:
        raise TypeError(f"make_graphed_callables: order must be a list of chunk ids, got {order!r}")
    if any(isinstance(e, bool) or not isinstance(e, int) or e == 0 for e in order):
        raise ValueError(
            f"make_graphed_callables: order entries are non-zero ints (+c forward of chunk c, -c "
            f"its backward), got {list(order)}"
        )
    chunks = max(abs(e) for e in order)
    mbs = sum(1 for e in order if e == 1)
    open_ = {}
    for i, e in enumerate(order):
        open_[abs(e)] = open_.get(abs(e), 0) + (1 if e > 0 else -1)
        if open_[abs(e)] < 0:
            raise ValueError(
                f"make_graphed_callables: order entry {i} ({e}) is a backward of chunk {abs(e)} "
                "before its forward"
            )
    counts = {c: (list(order).count(c), list(order).count(-c)) for c in range(1, chunks + 1)}
    if any(n != (mbs, mbs) for n in counts.values()):
        raise ValueError(
            "make_graphed_callables: every chunk 1..max(order) needs the same number of forwards "
            f"and backwards in order (one per microbatch); got {{chunk: (forwards, backwards)}} "
            f"{counts}"
        )
    return list(order), chunks, mbs


class Schedule:
    """The replay-order check of one capture.

    Events are (kind, runner) in the order the layout's steps run them. A forward must be the
    next event; so must a backward, and it must come from the runner's latest forward. A
    backward event is skipped when its forward ran without building an autograd graph
    (torch.no_grad, nothing requiring grad) or when that graph has been freed (the outputs were
    dropped): no backward can come for it.
    """

    def __init__(self, layout: Layout, names: list[str]):
        self.layout = layout
        self.names = names
        self.skippable: frozenset[int] = frozenset()  # runners a microbatch may leave out
        self.events: list[tuple[str, int]] = []
        for kind, unit in layout.steps:
            runners = unit.runners if kind == "forward" else unit.runners[::-1]
            self.events += [(kind, j) for j in runners]
        self.pos = 0
        self.pending: list[weakref.ref | None] = [None] * len(names)

    def _advance(self) -> None:
        self.pos = (self.pos + 1) % len(self.events)

    def _skip_dead_backwards(self) -> None:
        for _ in range(len(self.events)):
            kind, j = self.events[self.pos]
            if kind == "forward":
                return
            ref = self.pending[j]
            if ref is not None and ref() is not None:
                return
            self.pending[j] = None
            self._advance()

    def _alive(self, j: int) -> bool:
        ref = self.pending[j]
        return ref is not None and ref() is not None

    def is_pending(self, j: int) -> bool:
        """Whether runner j's last forward still waits for its backward."""
        return self._alive(j)

    def _skip_to(self, kind: str, j: int) -> bool:
        """Passes over the forwards of skippable runners and dead backwards when that reaches
        (kind, j); returns whether it did (nothing moves otherwise)."""
        if not self.skippable:
            return False
        p = self.pos
        for _ in range(len(self.events)):
            event = self.events[p]
            if event == (kind, j):
                self.pos = p
                return True
            k_kind, k = event
            if not ((k_kind == "forward" and k in self.skippable)
                    or (k_kind == "backward" and not self._alive(k))):  # fmt: skip
                return False
            p = (p + 1) % len(self.events)
        return False

    def _text(self, kind: str, j: int) -> str:
        where = self.layout.describe(j)
        return f"the {kind} of {self.names[j]}" + (f" ({where})" if where else "")

    def _mismatch(self, kind: str, j: int) -> ScheduleError:
        exp_kind, e = self.events[self.pos]
        if (exp_kind, e, kind) == ("backward", j, "forward"):
            msg = f"{self.names[j]}: called again before the backward of its previous call"
        else:
            msg = (
                "graphed callables replay in the captured order: expected "
                f"{self._text(exp_kind, e)} next, got {self._text(kind, j)}"
            )
        if exp_kind == "backward":
            msg += (
                ". The outputs of that earlier call still wait for their backward (their autograd"
                " graph is alive), and replaying another graph first would overwrite what that "
                "backward needs (the graphs share their static buffers and memory pool). Run that"
                " backward first; if it will never run, drop those outputs (del) or make the "
                "call under torch.no_grad()"
            )
        if self.layout.explicit:
            msg += f". Captured order: {self.layout.order}"
        return ScheduleError(msg)

    def check_forward(self, j: int) -> None:
        """Before runner j's forward replay: raises unless it is the next event."""
        self._skip_dead_backwards()
        if self.events[self.pos] != ("forward", j) and not self._skip_to("forward", j):
            raise self._mismatch("forward", j)

    def forward_done(self, j: int, ctx) -> None:
        """After runner j's forward replay; ctx is its autograd node, None if no backward."""
        self.pending[j] = None if ctx is None else weakref.ref(ctx)
        self._advance()

    def check_backward(self, j: int, ctx) -> None:
        """Before runner j's backward replay through the autograd node ctx."""
        ref = self.pending[j]
        if ref is None or ref() is not ctx:
            raise ScheduleError(
                f"{self._text('backward', j)} ran through the outputs of an earlier call: the "
                "graph has replayed since, or this backward already ran (retain_graph=True), so "
                "the activations it saved are gone. Backpropagate each call's outputs once, "
                "before calling the graphed callable again"
            )
        self._skip_dead_backwards()
        if self.events[self.pos] != ("backward", j) and not self._skip_to("backward", j):
            raise self._mismatch("backward", j)

    def backward_done(self, j: int) -> None:
        self.pending[j] = None
        self._advance()
