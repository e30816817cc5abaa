"""Sharded masters: `MasterWeights(model, shard_group=group)`, ZeRO-style over torch.distributed
(graphfp8.MasterWeights builds a ShardedMasterWeights when given shard_group: masters.py).

    masters = g8.MasterWeights(model, shard_group=group)     # every rank, same model
    opt = torch.optim.AdamW(masters.parameters(), fused=True)  # this rank's pieces only
    ... forward / backward of the local microbatches ...
    masters.clip_grad_norm_(1.0)    # optional: the global norm (reduce-scatters first)
    masters.step(opt)               # reduce-scatter, step the shard, quantize, all-gather
    masters.zero_grad()

Every trainable parameter - FP8 primary weights, norms, biases, embeddings, the head - lives in
flat buffers (shard_layout.py): the model keeps whole, replicated parameters at fixed
addresses (views of the flat buffers), so layer graphs and microbatch graphs are unchanged, and
each rank keeps only its slice of the fp32 masters, of their gradients and of the optimizer
state. One step, every collective in stream order (a step graph captures them all,
make_graphed_step(master_weights=masters)):

1. reduce_grads_: per bucket, the model's gradients (their dtype) flattened and reduce-scattered,
   divided by N (DDP's average, allreduce_gradients' arithmetic), into this rank's fp32 slice.
2. (clip_grad_norm_: the squared norm of the slices, one SUM all-reduce, torch's clip formula.)
3. optimizer.step() on the slices (as pieces: one tensor per parameter and rank, whose .grad is
   its view of the reduced slice; a norm of it raises, so torch.nn.utils.clip_grad_norm_ of
   masters.parameters() raises instead of clipping by this rank's norm).
4. write_back_: blockwise FP8 weights - each rank's 128x128 blocks from its own slice, no amax
   all-reduce (block_shards.py); other FP8 weights - each piece's amax, one MAX all-reduce of
   the vector of per-weight amaxes, the scales (current scaling, as
   graphfp8.fp8.primary.WeightQuantizer), scale_inv for every weight at once, each piece cast
   into its bytes of the FP8 buffer, the FP8 buffer (and the block scales) all-gathered as
   uint8, the transposes marked stale; other parameters - the slice rounded to the parameter
   dtype and all-gathered in it.

The result equals unsharded data parallel (allreduce_gradients, then an unsharded MasterWeights
stepping the same AdamW) bit for bit where the reductions agree: the amax is a maximum (exact
over any split), and a high-precision parameter of fp32 is its own master; with bf16 parameters
the sharded masters hold fp32 copies, which unsharded training does not (docs/sharding.md).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from graphfp8.distributed.block_shards import BlockShards
from graphfp8.distributed.collectives import all_gather_, reduce_scatter_
from graphfp8.distributed.data_parallel import (
    check_gradient_layout,
    check_same_settings,
    mark_sharded,
)
from graphfp8.distributed.group_quantize import GroupQuantizer
from graphfp8.distributed.shard_layout import ShardLayout
from graphfp8.distributed.sharded_guard import (
    GradWatch,
    ModelWatch,
    check_groups_reach,
    check_model,
    check_optimizer_kind,
    check_shard_group,
)
from graphfp8.distributed.sharded_masters_state import check_loadable, full_state, shard_state
from graphfp8.distributed.sharded_pieces import Piece, ShardGrad
from graphfp8.fp8.master import (
    TENSOR_GRAD,
    ClaimAnchor,
    MasterWeights,
    capturing,
    check_fp8_weights_kept,
    claim,
    clear_grads,
)
from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["ShardedMasterWeights"]


class ShardedMasterWeights(MasterWeights):
    """fp32 masters of every trainable parameter of `model`, sharded over `shard_group`.

    Args:
        model: the replicated model (every rank holds the same parameters, as DDP requires);
            FP8 primary weights (fp8_model_init) or not.
        shard_group: the torch.distributed group (NCCL on GPUs, gloo on CPUs) of N ranks.
        bucket_mb: the most gradient MiB per bucket (one reduce-scatter and one all-gather
            each; a larger parameter gets a bucket of its own).
        check_every_step: check on every reduction that the ranks hold the same gradients (one
            all_gather of 3 integers, a host sync with NCCL); False checks each gradient set
            once (see graphfp8.allreduce_gradients). A graph capture never checks.
        independent_groups: allow a shard_group smaller than the world, each group training
            a replica of its own (nothing reduces across groups); False refuses such a group.
    """

    def __init__(self, model: nn.Module, shard_group, bucket_mb: float = 25.0,
                 check_every_step: bool = True,
                 independent_groups: bool = False) -> None:  # fmt: skip
        if not dist.is_initialized():
            raise RuntimeError("MasterWeights(shard_group=...): torch.distributed is not "
                               "initialised (graphfp8.init_distributed)")  # fmt: skip
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        check_model(named)
        check_fp8_weights_kept(model, "MasterWeights(shard_group=...)")
        if not independent_groups:
            check_shard_group(shard_group)
        self.group, self.check_every_step = shard_group, check_every_step
        self.world, self.rank = dist.get_world_size(shard_group), dist.get_rank(shard_group)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.layout = ShardLayout(named, self.world, self.rank, self.bucket_bytes)
        described = self.layout.describe()
        check_same_settings({k: v for k, v in described.items() if k != "rank"}, shard_group)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.frozen_fp8 = [(n, p) for n, p in model.named_parameters()
                           if not p.requires_grad and isinstance(p, Float8Tensor)]  # fmt: skip
        self.fp8_params = [p for p in self.params if isinstance(p, Float8Tensor)]
        self.others = []  # every trainable parameter has a master here
        self._anchor = ClaimAnchor()
        claim(self.names, self.params, self._anchor)
        self._checked_optimizer = None
        self._reduced = False
        self._build_buffers()
        self._build_pieces()
        mark_sharded([*self.params, *self.masters], "MasterWeights(shard_group=...)")
        self.model_watch = None
        self.write_back_()
        self.model_watch = ModelWatch(self)  # sharded_guard.py
        self.grad_watch = GradWatch(self.names, self.params)

    # Construction ------------------------------------------------------------------------------

    def _build_buffers(self) -> None:
        """The flat buffers, filled from the parameters, which then become views of them."""
        by_name = dict(zip(self.names, self.params, strict=True))
        dev = self.params[0].device
        self.master_shards, self.grad_shards, self.flats = [], [], []
        self.weight_index: dict[str, int] = {}
        for bucket in self.layout.buckets:
            lo = self.rank * bucket.shard
            wire = torch.uint8 if bucket.fp8_dtype is not None else bucket.dtype
            flat = torch.zeros(bucket.padded(self.world), dtype=wire, device=dev)
            master = torch.zeros(bucket.shard, dtype=torch.float32, device=dev)
            for e in bucket.entries:
                p = by_name[e.name]
                hp = p.dequantize(torch.float32) if e.fp8_dtype is not None else p.detach()
                mine = slice(max(e.offset, lo), min(e.stop, lo + bucket.shard))
                if mine.start < mine.stop:
                    src = hp.reshape(-1)[mine.start - e.offset : mine.stop - e.offset]
                    master[mine.start - lo : mine.stop - lo].copy_(src)
                view = flat[e.offset : e.stop]
                with torch.no_grad():
                    if e.fp8_dtype is not None:
                        view.view(e.fp8_dtype).copy_(p._data.reshape(-1))
                        old, p._data = p._data, view.view(e.fp8_dtype).view(e.shape)
                        old.set_()  # freed; a graph captured before sees it moved and raises
                        if not bucket.stripe:  # blockwise weights: block_shards.py
                            self.weight_index[e.name] = len(self.weight_index)
                    else:
                        view.copy_(p.detach().reshape(-1))
                        p.data = view.view(e.shape)
            self.flats.append(flat)
            self.master_shards.append(master)
            self.grad_shards.append(torch.zeros_like(master))
        self._build_weight_vectors(by_name, dev)
        self.blocks = BlockShards(self.layout, by_name, dev)

    def _build_weight_vectors(self, by_name: dict, dev) -> None:
        """The FP8 weights' quantizer (group_quantize.py); each weight's scale_inv becomes
        a view of its vector (written for all weights at once)."""
        weights = [by_name[name] for name in self.weight_index]
        self.quantizer = GroupQuantizer([p.fp8_dtype for p in weights], dev)
        self.amax, self.scale = self.quantizer.amax, self.quantizer.scale
        for i, p in enumerate(weights):
            self.quantizer.scale_inv[i] = p._scale_inv
            old, p._scale_inv = p._scale_inv, self.quantizer.scale_inv[i : i + 1]
            old.set_()  # as the data (_build_buffers)

    def _build_pieces(self) -> None:
        """masters: one leaf fp32 tensor per piece (a view of the master slice), what the
        optimizer steps; its .grad a ShardGrad view of the gradient slice."""
        self.masters, self.piece_names = [], []
        # What clearing a piece's gradient clears (opt.zero_grad()): its parameter's gradient;
        # the first piece's also those of parameters with no piece on this rank.
        index = {n: i for i, n in enumerate(self.names)}
        mine = {p.entry.name for p in self.layout.pieces}
        elsewhere = [i for i, n in enumerate(self.names) if n not in mine]
        for piece in self.layout.pieces:
            lo = self.rank * self.layout.buckets[piece.bucket].shard
            span = slice(piece.start - lo, piece.stop - lo)
            master = torch.Tensor._make_subclass(Piece, self.master_shards[piece.bucket][span],
                                                 True)  # fmt: skip
            grad = torch.Tensor._make_subclass(ShardGrad, self.grad_shards[piece.bucket][span])
            master._graphfp8_owner = grad._graphfp8_owner = weakref.ref(self)
            clears = [index[piece.entry.name], *(elsewhere if not self.masters else ())]
            master._graphfp8_clears = grad._graphfp8_clears = clears
            TENSOR_GRAD.__set__(master, grad)
            self.masters.append(master)
            self.piece_names.append(piece.entry.name)

    # What the optimizer and a step graph see ---------------------------------------------------

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer updates: this rank's pieces of the fp32 masters."""
        return list(self.masters)

    def param_groups(self, groups: list[dict]) -> list[dict]:
        """Optimizer param groups of the model's parameters (nanoGPT's `p.dim() >= 2` decay
        split, built on the model as under DDP) as groups of this rank's pieces, options kept."""
        of = {}
        for name, piece in zip(self.piece_names, self.masters, strict=True):
            of.setdefault(name, []).append(piece)
        by_id = {id(p): n for n, p in zip(self.names, self.params, strict=True)}
        out = []
        for g in groups:
            names = [by_id.get(id(p)) for p in g["params"]]
            if None in names:
                raise ValueError("masters.param_groups: a group holds a tensor that is not one "
                                 "of the model's trainable parameters")  # fmt: skip
            out.append({**g, "params": [m for n in names for m in of.get(n, [])]})
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor that step() changes besides the model's and the optimizer's (a graph
        capture snapshots and restores them)."""
        return [*self.master_shards, self.scale, self.amax, *self.blocks.tensors()]

    def master_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(this rank's fp32 master slices, their gradient slices), as the memory report counts
        them."""
        return list(self.master_shards), list(self.grad_shards)

    def optimizer_params(self, model_params: list[torch.Tensor], name: str) -> list:
        """What an optimizer stepped with these masters holds: every piece; the masters must
        cover exactly `model_params` (the model's trainable parameters)."""
        if {id(p) for p in model_params} != {id(p) for p in self.params}:
            raise ValueError(
                f"{name}: master_weights=MasterWeights(model, shard_group=...) must be built "
                "over exactly this model's trainable parameters"
            )
        return self.parameters()

    # One step ----------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce_grads_(self) -> None:
        """The model's gradients, averaged over the group, into this rank's fp32 gradient
        slice (once per step: clip_grad_norm_ and step call it). Every trainable parameter
        needs a gradient (the ranks agree first; then all raise if one has none)."""
        if self._reduced:
            return
        self.grad_watch.check_unchanged(self.params)
        self.model_watch.adopt_changes()
        layout = [(i, tuple(p.shape), p.dtype) for i, p in enumerate(self.params)
                  if p.grad is not None]  # fmt: skip
        check_gradient_layout(layout, ("shard", self.bucket_bytes), self.group,
                              self.check_every_step)  # fmt: skip
        missing = [n for n, p in zip(self.names, self.params, strict=True) if p.grad is None]
        if missing:
            raise RuntimeError(
                f"MasterWeights(shard_group=...): {missing} have no gradient; sharded masters "
                "step every trainable parameter: freeze unused ones (requires_grad_(False)) "
                "before building the masters"
            )
        by_name = dict(zip(self.names, self.params, strict=True))
        for b, bucket in enumerate(self.layout.buckets):
            parts, at = [], 0
            for e in bucket.entries:
                if e.offset > at:
                    parts.append(self._zeros(e.offset - at, bucket.dtype))
                parts.append(by_name[e.name].grad.reshape(-1))
                at = e.stop
            parts.append(self._zeros(bucket.padded(self.world) - at, bucket.dtype))
            out = torch.empty(bucket.shard, dtype=bucket.dtype, device=self.amax.device)
            reduce_scatter_(out, torch.cat(parts), self.group)
            out.div_(self.world)
            self.grad_shards[b].copy_(out)
        self._reduced = self.grad_watch.reduced = True

    def _zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=self.amax.device)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips this rank's gradient slices by the global L2 norm over every rank (torch's
        clip_grad_norm_ formula: coef = min(1, max_norm / (norm + 1e-6))). Reduces the
        gradients first (once per step). Returns the norm (0-d float32)."""
        self.reduce_grads_()
        local = torch.stack(torch._foreach_norm(self.grad_shards)).square().sum()
        dist.all_reduce(local, group=self.group)
        norm = local.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(self.grad_shards, coef)
        return norm

    copy_grads_ = reduce_grads_  # MasterWeights' name for "the gradients into the masters"

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """reduce_grads_ (unless clip_grad_norm_ did), optimizer.step(), write_back_."""
        self._check_optimizer(optimizer)
        try:
            self.reduce_grads_()
            self.grad_watch.check_no_late_backward()
            optimizer.step()
            self.write_back_()
        finally:
            self._reduced = False  # the next step reduces its own gradients
            self.grad_watch.reset()

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per optimizer: it must hold every piece (or those slices would never train)."""
        if self._checked_optimizer is not None and self._checked_optimizer() is optimizer:
            return
        check_optimizer_kind(optimizer)
        check_groups_reach(optimizer, self.group)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = sorted({n for n, m in zip(self.piece_names, self.masters, strict=True)
                          if id(m) not in held})  # fmt: skip
        if missing:
            raise ValueError(
                f"MasterWeights.step: the optimizer does not hold this rank's fp32 masters of "
                f"{missing}, which would never train: build it over masters.parameters()"
            )
        self._checked_optimizer = weakref.ref(optimizer)

    @torch.no_grad()
    def write_back_(self) -> None:
        """Every parameter from the masters (module docstring, 4): FP8 weights quantized with
        one amax per weight over all ranks, then every bucket all-gathered."""
        if self.weight_index:
            pieces = [
                (self.weight_index[p.entry.name], m.detach(),
                 self.flats[p.bucket][p.start : p.stop].view(p.entry.fp8_dtype))
                for p, m in zip(self.layout.pieces, self.masters, strict=True)
                if p.entry.fp8_dtype is not None and not self.blocks.is_block(p)
            ]  # fmt: skip
            self.quantizer.quantize_(pieces, self.group)
        self.blocks.quantize_([(p, m.detach()) for p, m in zip(self.layout.pieces, self.masters,
                                                               strict=True)
                               if self.blocks.is_block(p)], self.flats)  # fmt: skip
        self.blocks.gather_(self.group)
        for b, bucket in enumerate(self.layout.buckets):
            lo = self.rank * bucket.shard
            mine = self.flats[b][lo : lo + bucket.shard]
            if bucket.fp8_dtype is None:
                mine.copy_(self.master_shards[b])
            all_gather_(self.flats[b], mine, self.group)
        for p in self.fp8_params:
            p.mark_data_changed(transpose_written=False)
        if self.model_watch is not None and not capturing():
            self.model_watch.remember()

    def clear_for_piece(self, indices: list[int], set_to_none: bool) -> None:
        """opt.zero_grad() clearing a piece's gradient: the model's gradients it stands for."""
        clear_grads([self.params[i] for i in indices], set_to_none)
        self._reduced = False
        self.grad_watch.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the model's gradients (the pieces' are rewritten by the next reduction)."""
        clear_grads(self.params, set_to_none)
        self._reduced = False
        self.grad_watch.reset()

    # Checkpoints (sharded_masters_state.py) ----------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's shard: {"layout", "masters" (one fp32 slice per bucket), "scales"}; the
        optimizer's state_dict is this rank's too, saved beside it."""
        return shard_state(self.layout, self.master_shards, self.scale)

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restores this rank's shard saved by state_dict() on the same rank of the same
        layout, then writes every parameter from it. A collective: the ranks agree that every
        shard loads before any is copied; otherwise all raise, naming both layouts."""
        self.check_loadable(state)
        for dst, src in zip(self.master_shards, state["masters"], strict=True):
            dst.copy_(src)
        self.scale.copy_(state["scales"])
        self.write_back_()

    def full_state_dict(self) -> dict | None:
        """The consolidated fp32 masters, on group rank 0 (None on the others; a collective):
        {"masters": {FP8 weight name: fp32}, "hp_masters": {other name: fp32}} - an unsharded
        MasterWeights loads it (its "masters"; a frozen FP8 weight's master is its dequantized
        value, as an unsharded MasterWeights seeds it)."""
        full = full_state(self.layout, self.master_shards, self.group)
        if full is not None:
            for name, p in self.frozen_fp8:
                full["masters"][name] = p.dequantize(torch.float32)
        return full

    def check_loadable(self, state) -> None:
        """Raises on every rank unless every rank's `state` loads (a collective, before anything
        is copied: sharded_masters_state.check_loadable)."""
        check_loadable(self.layout, self.master_shards, self.scale, self.group, state)
