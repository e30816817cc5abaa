"""FSDP2's explicit prefetch between per-layer FSDP2 graphs (docs/sharding.md, "FSDP2 layers in
make_graphed_callables"): `layers[i].set_modules_to_forward_prefetch([layers[i + 1]])` and
`layers[i].set_modules_to_backward_prefetch([layers[i - 1]])` among the layers of one capture.

As FSDP2's pre-forward (pre-backward) hook does, layer i's forward (backward) graph issues the
target's all-gather after its own and before its compute, so the collective overlaps that
compute; the target's graph then holds only the copy-out of that all-gather. The bits are those
of the layer's own all-gather (the same shards, the same collective), but the target's graph
reads what another graph wrote: each graph that is fed so is refused, before its replay, unless
the layer that feeds it has replayed its graph of that direction since the target's last one
(the tokens below), so that a graph never reads a stale gather. On CUDA the all-gather stream is
joined back into the capture stream at the end of the issuing graph (a graph's side streams end
inside it), so the overlap is with the issuing layer's compute.
"""

from __future__ import annotations

import torch

__all__ = ["PrefetchedBackward", "link_prefetch"]

KINDS = ("forward", "backward")


def link_prefetch(name: str, layers: list, whole: str) -> None:
    """Checks FSDP2's explicit prefetch of a capture's layers (forward: only to the next layer,
    backward: only to the previous one; no other module prefetching a graphed layer) and gives
    each layer its targets. Raises RuntimeError naming the fix otherwise."""
    index = {id(layer.state): i for i, layer in enumerate(layers)}
    for i, layer in enumerate(layers):
        st = layer.state
        fwd = [index.get(id(s)) for s in st._states_to_forward_prefetch]
        bwd = [index.get(id(s)) for s in st._states_to_backward_prefetch]
        if fwd not in ([], [i + 1]) or bwd not in ([], [i - 1]):
            raise RuntimeError(
                f"{name}: {layer.name} is in FSDP2's explicit prefetch (set_modules_to_forward_"
                "prefetch / set_modules_to_backward_prefetch) to modules other than its "
                "neighbours among the graphed layers; per-layer graphs take "
                "layers[i].set_modules_to_forward_prefetch([layers[i + 1]]) and "
                "layers[i].set_modules_to_backward_prefetch([layers[i - 1]]) of the callables "
                f"given, in their order. Set it so, or leave the prefetch unset, or {whole}"
            )
        layer.prefetch.targets = {"forward": layers[i + 1] if fwd else None,
                                  "backward": layers[i - 1] if bwd else None}  # fmt: skip
    for s in layers[0].state._state_ctx.all_states:
        targets = s._states_to_forward_prefetch + s._states_to_backward_prefetch
        if id(s) not in index and any(id(t) in index for t in targets):
            raise RuntimeError(
                f"{name}: a module that is not among the graphed layers is in FSDP2's explicit "
                "prefetch (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch) "
                "of one of them; that all-gather would be issued outside the layer's graphs. "
                f"Leave that prefetch unset, or {whole}"
            )


class Prefetch:
    """One layer's side of the prefetch: its targets, whether its own graphs were fed by another
    layer's (at capture), the tokens that say a feeding graph has run (at replay)."""

    def __init__(self, name: str):
        self.name = name
        self.targets: dict = {"forward": None, "backward": None}
        self.fed = {"forward": None, "backward": None}  # the feeding layer's name, at capture
        self.token = {"forward": False, "backward": False}
        self.joins: list = []

    def after_warmup(self, group) -> None:
        """Warmup runs each layer's forward and backward in turn, so a backward prefetched the
        layer before it for a backward that already ran: that gather is dropped, and what the
        capture finds fed starts anew."""
        result = group._all_gather_result
        event = None if result is None else result.all_gather_event
        if event is not None and group.device.type == "cuda":  # done before its memory goes
            torch.cuda.current_stream().wait_event(event)
        group._all_gather_result = None
        self.fed = {"forward": None, "backward": None}
        self.token = {"forward": False, "backward": False}

    def issue(self, kind: str) -> None:
        """At capture, after the layer's own all-gather: the target's all-gather for `kind`, as
        FSDP2's _prefetch_unshard runs it (nothing when the target is gathered already)."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        target = self.targets[kind]
        if target is None:
            return
        group = target.group
        cuda = group.device.type == "cuda"
        if cuda:  # the all-gather streams fork from the capture stream
            current, comm = torch.cuda.current_stream(), group.comm_ctx
            comm.all_gather_copy_in_stream.wait_stream(current)
            comm.all_gather_stream.wait_stream(current)
        state = TrainingState.FORWARD if kind == "forward" else TrainingState.PRE_BACKWARD
        with group.use_training_state(state):
            group.unshard()
        if group._all_gather_result is not None:
            target.prefetch.fed[kind] = self.name
            if cuda:
                self.joins.append(group)

    def join(self) -> None:
        """At the end of the issuing capture (CUDA): the capture stream waits for the prefetched
        all-gathers, whose events the target's capture then no longer waits on (they belong to
        this graph)."""
        current = torch.cuda.current_stream() if self.joins else None
        for group in self.joins:
            result = group._all_gather_result
            if result is not None and result.all_gather_event is not None:
                current.wait_event(result.all_gather_event)
                group._all_gather_result = result._replace(all_gather_event=None)
            current.wait_stream(group.comm_ctx.all_gather_copy_in_stream)
            current.wait_stream(group.comm_ctx.all_gather_stream)
        self.joins = []

    def check(self, kind: str) -> None:
        """Before a replay of the layer's `kind` graph: refused if it reads a prefetched
        all-gather that its feeding layer's graph has not issued since its last replay."""
        feeder = self.fed[kind]
        if feeder is not None and not self.token[kind]:
            raise RuntimeError(
                f"make_graphed_callables: the {kind} graph of {self.name} reads the all-gather "
                f"that the {kind} graph of {feeder} issues (FSDP2's explicit prefetch, "
                f"set_modules_to_{kind}_prefetch), but that graph has not run since this one "
                "last did: call the graphed layers in the order they were captured, every "
                "microbatch, or capture without the prefetch"
            )

    def take(self, kind: str) -> None:
        self.token[kind] = False

    def wrap(self, acc):
        """The backward replay's accumulator, with the tokens around it when this layer's
        backward graph feeds another's or is fed."""
        target = self.targets["backward"]
        feeds = target is not None and target.prefetch.fed["backward"] is not None
        return PrefetchedBackward(self, acc) if feeds or self.fed["backward"] else acc

    def done(self, kind: str) -> None:
        """After a replay of the layer's `kind` graph: its target's graph may read what it
        issued."""
        target = self.targets[kind]
        if target is not None and target.prefetch.fed[kind] is not None:
            target.prefetch.token[kind] = True


class PrefetchedBackward:
    """A prefetching or prefetched layer's backward replay bookkeeping (GraphPair's
    accumulator): the tokens around the inner accumulator's (graphs/fsdp.py's FSDPGrads, or
    graphs/fsdp_layer_sync.py's SyncLastGrads)."""

    def __init__(self, prefetch: Prefetch, inner):
        self.prefetch, self.inner = prefetch, inner
        self.reset_graph = inner.reset_graph
        self.sync_graph = getattr(inner, "sync_graph", None)

    def before_replay(self) -> None:
        self.prefetch.check("backward")
        self.inner.before_replay()
        self.prefetch.take("backward")

    def after_replay(self) -> None:
        self.inner.after_replay()
        self.prefetch.done("backward")

    def replay_leaving_grads(self, graph) -> None:
        self.prefetch.check("backward")
        self.inner.replay_leaving_grads(graph)
        self.prefetch.take("backward")
        self.prefetch.done("backward")
