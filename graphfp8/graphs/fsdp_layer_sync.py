"""Gradient accumulation without communication in per-layer FSDP2 graphs
(make_graphed_callables(..., fsdp_sync="last"); docs/sharding.md, "FSDP2 layers in
make_graphed_callables"): each FSDP2 layer's backward graph adds its parameters' unsharded
gradients into persistent buffers and holds no reduce-scatter; a third graph per layer, the sync
graph, holds FSDP2's post_backward of those sums (the reduce-scatter, its division, the add into
the sharded `.grad`, the reshard), replayed after the layer's backward when FSDP2's gradient sync
is on (`set_requires_gradient_sync(True)`: the last microbatch), as eager FSDP2 reduces then.

Bits: eager FSDP2 assigns the first microbatch's unsharded gradient and adds the next ones into
it (AccumulateGrad; under MixedPrecisionPolicy with another reduce_dtype the first is cast to it
and the next ones added into that, FSDPParam.to_accumulated_grad_if_needed); the buffers start
at -0.0 (-0.0 + g is g bit for bit) and add every microbatch's gradient in the same dtype, so
the reduce-scatter reads the same sums.
"""

from __future__ import annotations

import torch

from graphfp8.graphs.backends import new_graph
from graphfp8.graphs.grads import fill_minus_zero

__all__ = ["SyncLast", "SyncLastGrads"]


class SyncLast:
    """One FSDP2 layer's unsharded gradient sums: found in warmup (seen), added into at the
    backward's capture (accumulate), reduced by the sync graph (capture)."""

    def __init__(self, name: str):
        self.name = name
        self.seen_grads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.entries: list[tuple[torch.Tensor, object, torch.Tensor, bool]] = []

    @property
    def ready(self) -> bool:
        """After warmup: the buffers exist, the backward being captured accumulates."""
        return bool(self.entries)

    def seen(self, params, grads) -> None:
        """A warmup backward's unsharded parameters and their gradients (their dtypes)."""
        self.seen_grads = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]

    def build(self, group) -> None:
        """After warmup: a zero buffer per parameter that got a gradient, in the dtype FSDP2
        accumulates it in (its reduce_dtype when MixedPrecisionPolicy's differs)."""
        by_param = {id(fp._unsharded_param): fp for fp in group.fsdp_params
                    if hasattr(fp, "_unsharded_param")}  # fmt: skip
        self.entries = []
        for p, g in self.seen_grads:
            fp = by_param[id(p)]
            upcast = fp.reduce_dtype is not None and g.dtype != fp.reduce_dtype
            dtype = fp.reduce_dtype if upcast else g.dtype
            buf = torch.zeros(g.shape, dtype=dtype, device=g.device)
            self.entries.append((p, fp, buf, upcast))
        self.seen_grads = []
        if not self.entries:
            raise ValueError(f"{self.name}: no parameter gets a gradient from the loss")

    def accumulate(self, params, grads) -> None:
        """Inside the backward's capture: each parameter's gradient added into its buffer."""
        ids = {id(p): g for p, g in zip(params, grads, strict=True)}
        for p, _, buf, _ in self.entries:
            buf.add_(ids[id(p)])

    def capture(self, layer, session, index: int, sharded) -> SyncLastGrads:
        """Captures the sync graph (the sums handed to FSDP2 as its unsharded gradients, then
        FSDPLayer.reduce) and the buffers' fill with -0.0; returns the pair's accumulator."""
        buffers = [buf for _, _, buf, _ in self.entries]
        graph = session.new_graph()
        with session.capture_into(graph, index):
            for p, fp, buf, upcast in self.entries:
                if upcast:
                    fp.unsharded_accumulated_grad = buf
                else:
                    p.grad = buf
            layer.reduce()
        clear = new_graph(session.device)
        with clear.capture(session.pool):
            fill_minus_zero(buffers)  # as the sharded .grad buffers' fill (graphs/grads.py)
        return SyncLastGrads(self.name, layer.group, graph, clear, sharded)


class _Graphs:
    """The graphs a GraphPair's release() frees through its accumulator's reset_graph."""

    def __init__(self, *graphs):
        self.graphs = graphs

    def release(self) -> None:
        for g in self.graphs:
            g.release()


class SyncLastGrads:
    """A sync-last FSDP2 layer's backward replay bookkeeping (GraphPair's accumulator): the
    buffers filled with -0.0 before the first backward after a sync; after each backward, when
    FSDP2's gradient sync is on, the sync graph with the sharded `.grad` bookkeeping around it
    (graphs/fsdp.py's FSDPGrads accumulator: -0.0 fill after zero_grad(set_to_none=True), the
    user's `.grad` copied in and out)."""

    def __init__(self, name: str, group, sync_graph, clear_graph, sharded):
        self.name, self.group = name, group
        self.sync_graph, self.clear_graph, self.sharded = sync_graph, clear_graph, sharded
        self.reset_graph = _Graphs(sync_graph, clear_graph, sharded.reset_graph)
        self.fresh = True

    def before_replay(self) -> None:
        if self.fresh:
            self.clear_graph.replay()
            self.fresh = False

    def after_replay(self) -> None:
        if not self.group.reduce_grads:
            return
        self.sharded.before_replay()
        self.sync_graph.replay()
        self.sharded.after_replay()
        self.fresh = True

    def replay_leaving_grads(self, graph) -> None:
        raise RuntimeError(
            f"make_graphed_callables: {self.name} was captured with fsdp_sync='last', and this "
            "backward leaves the parameters' gradients out (torch.autograd.grad(loss, inputs) "
            "or backward(inputs=...)); its graph adds them into FSDP2's unsharded gradient "
            "sums. Run backward() over the parameters too, or capture with fsdp_sync='every'"
        )
