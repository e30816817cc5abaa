"""What keeps the sharded masters' DDP-like idioms honest (docs/sharding.md, "Idioms"): the
optimizers and param groups they accept, the group they shard over, the gradients written after
a backward, and a model changed behind the masters' back (load_state_dict) adopted."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from graphfp8.fp8.master import capturing
from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["ELEMENTWISE_OPTIMIZERS", "GradWatch", "ModelWatch", "check_groups_reach",
           "check_model", "check_optimizer_kind", "check_shard_group"]  # fmt: skip

# Optimizers whose update of an element reads only that element's state (and scalars): stepping
# 1-D slices equals stepping the whole parameters. Adafactor (factored second moments), LBFGS,
# and norm-based ones (LAMB, Muon) read a parameter's shape or norm and would differ.
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "RMSprop",
        "Adadelta",
        "ASGD",
    )  # fmt: skip
    if hasattr(torch.optim, name)
)


def check_optimizer_kind(optimizer: torch.optim.Optimizer) -> None:
    """Raises unless `optimizer` is one of ELEMENTWISE_OPTIMIZERS (exactly, not a subclass) or
    declares `graphfp8_elementwise = True`."""
    kind = type(optimizer)
    if kind in ELEMENTWISE_OPTIMIZERS or getattr(optimizer, "graphfp8_elementwise", False):
        return
    names = ", ".join(k.__name__ for k in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        f"MasterWeights(shard_group=...).step: {kind.__name__} is not an elementwise optimizer "
        f"known to graphfp8 ({names}); the sharded masters step 1-D slices of each parameter, so "
        "an optimizer that reads a parameter's shape or norm (Adafactor, LAMB, Muon, LBFGS) "
        "would differ from unsharded training: use one of those, or unsharded masters; an "
        "elementwise optimizer of your own may set `graphfp8_elementwise = True`"
    )


def check_groups_reach(optimizer: torch.optim.Optimizer, group) -> None:
    """Raises on every rank if a param group holds no piece on any rank: a group filtered by
    the pieces' shape (`p.ndim < 2`: every piece is 1-D) whose options would never apply. A
    collective (one all_reduce of the group sizes)."""
    sizes = torch.tensor([len(g["params"]) for g in optimizer.param_groups], dtype=torch.int64)
    dev = next(p for g in optimizer.param_groups for p in g["params"]).device
    sizes = sizes.to(dev)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sizes, group=group)
    empty = [i for i, n in enumerate(sizes.tolist()) if n == 0]
    if empty:
        raise ValueError(
            f"MasterWeights(shard_group=...).step: param groups {empty} hold no master on any "
            "rank (every sharded piece is 1-D, so a filter such as `p.ndim < 2` over "
            "masters.parameters() puts them all in one group): build the groups from the "
            "model's parameters with masters.param_groups([{'params': decay, ...}, ...])"
        )


def check_shard_group(shard_group) -> None:
    """The sharded masters average over the whole world: a smaller group leaves the other
    ranks' replicas to drift (hybrid sharding is not built)."""
    world, size = dist.get_world_size(), dist.get_world_size(shard_group)
    if size != world:
        raise ValueError(
            f"MasterWeights(shard_group=...): the group has {size} of the {world} ranks; the "
            "sharded masters reduce over their group only, so replicas in other groups would "
            "drift apart: shard over every rank (shard_group=torch.distributed.group.WORLD), or "
            "pass independent_groups=True if each group is to train a replica of its own"
        )


class GradWatch:
    """Hooks on the parameters' gradient accumulators (autograd nodes: a graph capture refuses
    tensor hooks) recording each gradient's version after its last backward. A gradient written
    in place afterwards, before the reduction (torch.nn.utils.clip_grad_norm_(model.parameters())
    clips by this rank's norm), or a backward after the reduction (after masters.clip_grad_norm_)
    is refused. Graph replays run no hooks: nothing is recorded for them, nothing checked."""

    def __init__(self, names: list[str], params: list[torch.Tensor]) -> None:
        self.names, self.versions = names, {}
        self.reduced, self.late = False, None
        me = weakref.ref(self)
        # The accumulators live while someone holds them: the watch does.
        self.nodes = [get_gradient_edge(p).node for p in params]
        self.handles = [n.register_hook(_hook(me, i, p)) for i, (n, p)
                        in enumerate(zip(self.nodes, params, strict=True))]  # fmt: skip

    def backward_done(self, i: int, p: torch.Tensor) -> None:
        if capturing():  # a step graph's warmup: the graph owns the step from now on
            self.release()
            return
        if self.reduced and self.late is None:
            self.late = self.names[i]
        self.versions[i] = (id(p.grad), p.grad._version)

    def check_unchanged(self, params: list[torch.Tensor]) -> None:
        """Before the reduction: every gradient as its last backward left it. A step graph's
        warmup reduces too: the watch lets go there, before the capture (its backward runs
        torch.autograd.grad, which runs no accumulator and so no hook of ours)."""
        if capturing():
            self.release()
            return
        # The same gradient tensor written since (a new one is a new backward's).
        changed = [self.names[i] for i, (ident, v) in self.versions.items()
                   if id(params[i].grad) == ident and params[i].grad._version != v]  # fmt: skip
        if changed:
            raise RuntimeError(
                f"MasterWeights(shard_group=...): the gradients of {changed[:3]}"
                f"{' ...' if len(changed) > 3 else ''} were changed in place after the backward, "
                "before the masters reduced them (torch.nn.utils.clip_grad_norm_(model."
                "parameters()) clips each rank's unreduced gradients by its own norm): clip with "
                "masters.clip_grad_norm_(max_norm), which clips by the global norm of the "
                "averaged gradients; scale the loss rather than the gradients"
            )

    def check_no_late_backward(self) -> None:
        """Before the optimizer steps: no backward since the reduction."""
        if self.late is not None:
            late, self.late = self.late, None
            raise RuntimeError(
                f"MasterWeights(shard_group=...).step: a backward ran after the gradients were "
                f"reduced (by masters.clip_grad_norm_; {late!r} got a gradient since), so it "
                "would be dropped: run every backward of the step before clip_grad_norm_"
            )

    def reset(self) -> None:
        self.versions, self.reduced, self.late = {}, False, None

    def release(self) -> None:
        """Lets the accumulators go, hooks and all. Made on the eager stream and kept alive, they
        would tie a CUDA capture's backward to that stream ("operation would make the legacy
        stream depend on a capturing blocking stream", H200 2026-12-01); a graph's replays run
        no hook anyway, so a captured step needs no watch. Called from a hook, so the hooks are
        not removed (that would change the dict the backward iterates): they go with their
        accumulators once the running backward lets them go."""
        self.nodes, self.handles = [], []
        self.reset()


def _hook(watch: weakref.ref, i: int, param: torch.Tensor):
    ref = weakref.ref(param)

    def hook(grad_inputs, grad_outputs) -> None:
        w, p = watch(), ref()
        if w is not None and p is not None and p.grad is not None:
            w.backward_done(i, p)

    return hook


class ModelWatch:
    """What write_back_ left in this rank's range of the model (and the FP8 scale_invs): a
    model changed since (model.load_state_dict after building the masters) is adopted by the
    masters before the next reduction, as DDP steps whatever the parameters hold. Eager only:
    a graph replay steps the masters it captured."""

    def __init__(self, masters) -> None:
        self.m = masters
        self.remember()

    def _versions(self) -> list[int]:
        return [p._data._version if isinstance(p, Float8Tensor) else p._version
                for p in self.m.params] + [t._version for t in self._scales()]  # fmt: skip

    def _scales(self) -> list[torch.Tensor]:
        """The FP8 weights' scale_inv vector and the blockwise weights' block scales."""
        return [self.m.quantizer.scale_inv, *self.m.blocks.tensors()]

    @torch.no_grad()
    def remember(self) -> None:
        m = self.m
        self.mine = [f[m.rank * b.shard : (m.rank + 1) * b.shard].clone()
                     for f, b in zip(m.flats, m.layout.buckets, strict=True)]  # fmt: skip
        self.scale_inv = m.quantizer.scale_inv.clone()
        self.blocks = [t.clone() for t in m.blocks.tensors()]
        self.versions = self._versions()

    @torch.no_grad()
    def adopt_changes(self) -> None:
        """Reseeds the master pieces whose model bytes (or FP8 scale_inv) changed since the
        last write_back_, from the model, as construction seeds them."""
        if capturing() or self._versions() == self.versions:
            return
        m, by_name = self.m, dict(zip(self.m.names, self.m.params, strict=True))
        scale_changed = self.scale_inv != m.quantizer.scale_inv
        blocks_changed = any(not torch.equal(a, b) for a, b in
                             zip(self.blocks, m.blocks.tensors(), strict=True))  # fmt: skip
        for piece, master in zip(m.layout.pieces, m.masters, strict=True):
            e, lo = piece.entry, m.rank * m.layout.buckets[piece.bucket].shard
            now = m.flats[piece.bucket][piece.start : piece.stop]
            seen = self.mine[piece.bucket][piece.start - lo : piece.stop - lo]
            fp8 = e.fp8_dtype is not None
            if m.blocks.is_block(piece):  # blockwise: any block scale changed reseeds them all
                rescaled = blocks_changed
            else:
                rescaled = fp8 and bool(scale_changed[m.weight_index[e.name]])
            if torch.equal(now, seen) and not rescaled:
                continue
            p = by_name[e.name]
            hp = p.dequantize(torch.float32) if fp8 else p.detach()
            master.detach().copy_(hp.reshape(-1)[piece.start - e.offset : piece.stop - e.offset])
        self.remember()


def check_model(named: list[tuple[str, torch.Tensor]]) -> None:
    """The trainable (name, parameter) pairs can be sharded: some, none a DTensor, one device."""
    if not named:
        raise ValueError("MasterWeights(shard_group=...): the model has no trainable parameter")
    for name, p in named:
        if hasattr(p, "_local_tensor"):  # a DTensor
            raise TypeError(
                f"MasterWeights(shard_group=...): {name} is a DTensor (a model under "
                "fully_shard / FSDP2, which shards it already); shard a replicated model with "
                "MasterWeights(shard_group=...), or train the FSDP2 model with an unsharded "
                "MasterWeights (docs/sharding.md)"
            )
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        where = sorted(map(str, devices))
        raise ValueError(f"MasterWeights(shard_group=...): parameters on {where}; sharding needs "
                         "one device per rank")  # fmt: skip
