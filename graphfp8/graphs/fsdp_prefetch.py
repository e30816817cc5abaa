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
inside it), so the overlap is with the issuing layer's compute. A prefetch set, changed or
removed after capture is refused before the next replay (PrefetchSettings, in FSDPSettings).
"""

from __future__ import annotations

import torch

from graphfp8.graphs.fsdp_compat import param_groups

__all__ = ["PrefetchSettings", "PrefetchedBackward", "drop_gather", "link_prefetch"]

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


def _named(state) -> str:
    groups = param_groups(state)
    fqn = groups[0]._module_fqn if groups else None
    return fqn if fqn else "the root" if state._is_root else type(state._modules[0]).__name__


def _names(states) -> str:
    return "[" + ", ".join(map(_named, states)) + "]"


def drop_gather(group) -> None:
    """Drops an all-gather issued for a sharded `group` that no graph will read (done first on
    CUDA, before its memory goes)."""
    result = group._all_gather_result
    event = None if result is None else result.all_gather_event
    if event is not None and group.device.type == "cuda":
        torch.cuda.current_stream().wait_event(event)
    group._all_gather_result = None


class PrefetchSettings:
    """FSDP2's explicit prefetch (set_modules_to_forward_prefetch / set_modules_to_backward_
    prefetch) that concerns the fully_shard-ed modules of `model` as the capture left it - each
    one's targets, and every FSDP2 module's that prefetches one of them, in order - compared
    before every replay (graphs/fsdp.py's FSDPSettings): a graph replays the all-gathers it
    issued at capture, where eager FSDP2 would now gather other modules (docs/sharding.md).

    Args:
        entry: the entry point, for messages.
        model: the graphed module (a layer, or the whole model).
        groups: its FSDP2 parameter groups.
    """

    def __init__(self, entry: str, model, groups: list):
        from torch.distributed.fsdp import FSDPModule

        self.entry, self.groups = entry, groups
        states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
        self.own = {id(st) for st in states}
        self.first = states[0] if states else None
        self.saved = self._concerning()
        self.seen = self._everything()

    def _states(self) -> list:
        if self.first is None:
            return []
        return self.first._state_ctx.all_states or [self.first]

    def _everything(self) -> tuple[list, list]:
        """Every module's lists, copied: an unchanged tree passes on one comparison."""
        states = self._states()
        return list(states), [list(x) for x in _lists(states)]

    def _concerning(self) -> dict:
        """{(state id, kind): (state, kind, targets)} of the prefetch concerning the model."""
        found = {}
        for st in self._states():
            for kind in KINDS:
                targets = list(getattr(st, f"_states_to_{kind}_prefetch"))
                if id(st) in self.own or any(id(t) in self.own for t in targets):
                    found[id(st), kind] = (st, kind, targets)
        return found

    def check(self) -> None:
        """Raises RuntimeError naming the module, its lists before and after and the fix when
        the prefetch concerning the model changed since capture. The all-gather that an eager
        module's new prefetch left for a sharded group of the model is dropped first: no later
        call reads it stale."""
        states = self._states()
        if states == self.seen[0] and _lists(states) == self.seen[1]:
            return
        was, now = self.saved, self._concerning()
        for key in list(was) + [k for k in now if k not in was]:
            st, kind, old = was.get(key) or (*now[key][:2], [])
            targets = now[key][2] if key in now else []
            if [id(t) for t in targets] != [id(t) for t in old]:
                break
        else:
            self.seen = self._everything()  # a change elsewhere: the fast path again
            return
        for group in self.groups:
            if group.is_sharded:
                drop_gather(group)
        raise RuntimeError(
            f"{self.entry}: FSDP2's explicit prefetch of {_named(st)} (set_modules_to_{kind}_"
            f"prefetch) changed since capture ({_names(old)} -> {_names(targets)}); the graphs "
            "replay the all-gathers they issued at capture. Put the prefetch back as it was, or "
            "capture again (after reset() for per-layer graphs) with the new prefetch"
        )


def _lists(states) -> list:
    return [x for st in states
            for x in (st._states_to_forward_prefetch, st._states_to_backward_prefetch)]  # fmt: skip


class Prefetch:
    """One layer's side of the prefetch: its targets, whether its own graphs were fed by another
    layer's (at capture), the tokens that say a feeding graph has run (at replay)."""

    def __init__(self, name: str):
        self.name = name
        self.targets: dict = {"forward": None, "backward": None}
        self.fed = {"forward": None, "backward": None}  # the feeding layer's name, at capture
        self.token = {"forward": False, "backward": False}
        self.joins: list = []
        self.settings = None  # the layer's FSDPSettings (graphs/fsdp.py), taken after capture

    def after_warmup(self, group) -> None:
        """Warmup runs each layer's forward and backward in turn, so a backward prefetched the
        layer before it for a backward that already ran: that gather is dropped, and what the
        capture finds fed starts anew."""
        drop_gather(group)
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
        """The backward replay's accumulator, with the layer's FSDP2 settings and prefetch
        checked before it (changed between forward and backward: refused as at the forward) and
        the tokens around it."""
        return PrefetchedBackward(self, acc)

    def check_settings(self) -> None:
        if self.settings is not None:
            self.settings.check()

    def done(self, kind: str) -> None:
        """After a replay of the layer's `kind` graph: its target's graph may read what it
        issued."""
        target = self.targets[kind]
        if target is not None and target.prefetch.fed[kind] is not None:
            target.prefetch.token[kind] = True


class PrefetchedBackward:
    """An FSDP2 layer's backward replay bookkeeping (GraphPair's accumulator): its settings
    checked, the prefetch tokens around the inner accumulator's (graphs/fsdp.py's FSDPGrads, or
    graphs/fsdp_layer_sync.py's SyncLastGrads)."""

    def __init__(self, prefetch: Prefetch, inner):
        self.prefetch, self.inner = prefetch, inner
        self.reset_graph = inner.reset_graph
        self.sync_graph = getattr(inner, "sync_graph", None)

    def before_replay(self) -> None:
        self.prefetch.check_settings()
        self.prefetch.check("backward")
        self.inner.before_replay()
        self.prefetch.take("backward")

    def after_replay(self) -> None:
        self.inner.after_replay()
        self.prefetch.done("backward")

    def replay_leaving_grads(self, graph) -> None:
        self.prefetch.check_settings()
        self.prefetch.check("backward")
        self.inner.replay_leaving_grads(graph)
        self.prefetch.take("backward")
        self.prefetch.done("backward")
