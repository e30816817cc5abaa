"""Checkpoints that move between world sizes: a model under FSDP2 or with sharded masters, its
masters and its optimizer through torch.distributed.checkpoint (DCP), saved at N ranks and loaded
at M (docs/sharding.md, "Checkpoints across world sizes").

Every sharded tensor is saved with where its rows or elements lie, so DCP reads each rank's part
at any M: an FSDP2 model's parameters and the masters of FSDPMasterWeights are DTensors (row
chunks); the sharded masters' pieces (distributed/shard_layout.py: element ranges of each flattened
parameter) and their optimizer state become 1-D ShardedTensors of the whole parameter. The
optimizer's state is keyed by parameter name, not by its position in this rank's optimizer. The
loading model needs no forward first: init_fp8_state gives its FP8 state its final size and the
optimizer's state is created by one step with zero gradients at learning rate 0 (DCP loads into
tensors that exist).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

from graphfp8.distributed.sharded_masters import ShardedMasterWeights
from graphfp8.fp8.arena_check import needs_reduction
from graphfp8.fp8.master import MasterWeights
from graphfp8.fp8.recipe import Recipe, is_current_scaling
from graphfp8.modules.carry import init_fp8_state

__all__ = ["load", "save", "state_dict"]


def _sharded(local: torch.Tensor, start: int, numel: int, group) -> torch.Tensor:
    """A 1-D ShardedTensor of `numel` elements whose piece on this rank is `local` at element
    `start` (`local` empty: none here). A collective of `group`."""
    shards = []
    if local.numel():
        where = f"rank:{dist.get_rank()}/{local.device}"
        shards = [Shard(local, ShardMetadata([start], [local.numel()], where))]
    return init_from_local_shards(shards, numel, process_group=group)


def _sharded_masters(masters, optimizer) -> tuple[dict, dict, dict]:
    """(masters, optimizer state, names by piece id) of ShardedMasterWeights: per parameter name
    its fp32 master and each optimizer state tensor of the piece's size as a 1-D ShardedTensor
    over the group (the pieces themselves: DCP loads into them); scalars (AdamW's step) as
    they are. A collective, the same calls on every rank: a rank holds at most one piece of a
    parameter, and every piece the same state keys (AdamW: `exp_avg`, `exp_avg_sq`)."""
    pieces = zip(masters.layout.pieces, masters.masters, strict=True)
    by_name = {p.entry.name: (p, m) for p, m in pieces}
    sample = next((optimizer.state[m] for m in masters.masters if m in optimizer.state), {})
    vector_keys = sorted(k for k, v in sample.items() if torch.is_tensor(v) and v.dim() == 1)
    out, opt_state, names = {}, {}, {}
    for name, param in zip(masters.names, masters.params, strict=True):
        piece, master = by_name.get(name, (None, None))
        start = piece.start - piece.entry.offset if piece else 0
        empty = torch.empty(0, dtype=torch.float32, device=param.device)
        state = optimizer.state.get(master, {}) if piece else {}
        out[name] = _sharded(master.detach() if piece else empty, start, param.numel(),
                             masters.group)  # fmt: skip
        entry = {k: _sharded(state[k] if piece else empty, start, param.numel(), masters.group)
                 for k in vector_keys}  # fmt: skip
        opt_state[name] = {**{k: v for k, v in state.items() if k not in entry}, **entry}
        if piece:
            names[id(master)] = name
    return out, opt_state, names


def _names(model: nn.Module, masters: MasterWeights) -> dict[int, str]:
    """The name of every tensor an optimizer over masters.parameters() holds, by id."""
    names = {id(p): n for n, p in model.named_parameters()}
    names.update({id(m): n for n, m in zip(masters.names, masters.masters, strict=True)})
    return names


def state_dict(model: nn.Module, masters: MasterWeights, optimizer) -> dict:
    """{"model": model.state_dict(), "masters", "optim": {"state": {name: {key: tensor}},
    "param_groups": {index: hyperparameters and parameter names}}}: what save writes and load
    fills in place. Sharded masters: a collective."""
    if isinstance(masters, ShardedMasterWeights):
        master_state, opt_state, names = _sharded_masters(masters, optimizer)
        scales = {"scales": masters.scale}
    else:
        master_state = masters.state_dict()["masters"]
        names = _names(model, masters)
        opt_state = {names[id(p)]: s for p, s in optimizer.state.items()}
        scales = {}
    groups = {
        str(i): {**{k: v for k, v in g.items() if k != "params"},
                 "params": [names[id(p)] for p in g["params"] if id(p) in names]}
        for i, g in enumerate(optimizer.param_groups)
    }  # fmt: skip
    return {
        "model": model.state_dict(),
        "masters": master_state,
        **scales,
        "optim": {"state": opt_state, "param_groups": groups},
    }


def _reduce_pending_amaxes(model: nn.Module, fp8_group) -> None:
    """Row 0 of every delayed-scaling amax history (the amaxes recorded since the last update,
    this rank's own) MAX-reduced over `fp8_group` in place, which the next update's reduction
    leaves as it is: the FP8 state is then the same on every rank, and one copy of it is what
    DCP keeps. Raises when the ranks' FP8 states are their own (no fp8_group)."""
    arenas = {}
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        if meta is not None and not is_current_scaling(meta.recipe):
            for arena in (meta.fwd.arena, meta.bwd.arena):
                arenas.setdefault(id(arena), arena)
    if not arenas or dist.get_world_size() == 1:
        return
    if not needs_reduction(fp8_group) or not all(a.recipe.reduce_amax for a in arenas.values()):
        raise ValueError(
            "dcp_checkpoint.save: each rank's FP8 amax histories are its own (no fp8_group, or "
            "a recipe with reduce_amax=False), and a checkpoint that loads at any world size "
            "keeps one: train with fp8_autocast(fp8_group=...) and pass it as fp8_group"
        )
    for arena in arenas.values():
        if arena.num_slots:
            dist.all_reduce(arena.amax_history[0], op=dist.ReduceOp.MAX, group=fp8_group)


def save(path, model: nn.Module, masters: MasterWeights, optimizer, *, fp8_group) -> None:
    """Writes the training state at `path` (a directory) through DCP; a collective. fp8_group:
    the fp8_autocast group of the training (its amaxes are reduced first)."""
    _reduce_pending_amaxes(model, fp8_group)
    dcp.save(state_dict(model, masters, optimizer), checkpoint_id=path)


@torch.no_grad()
def _init_optimizer_state(optimizer) -> None:
    """The optimizer's state, created by one step at learning rate 0 (which leaves every
    parameter as it is; the state it makes is overwritten by the load), unless it has some."""
    if optimizer.state:
        return
    # Those without a gradient get zeros (sharded masters' pieces hold theirs: views).
    params = [p for g in optimizer.param_groups for p in g["params"]
              if p.requires_grad and p.grad is None]  # fmt: skip
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


@torch.no_grad()
def load(path, model: nn.Module, masters: MasterWeights, optimizer, recipe: Recipe) -> None:
    """Loads the training state that save() wrote at `path`, at this run's world size, into a
    fresh model (its FP8 state for `recipe` made now), its masters and its optimizer (built over
    masters.parameters()); a collective."""
    device = next(model.parameters()).device
    init_fp8_state(model, recipe, device)
    _init_optimizer_state(optimizer)
    state = state_dict(model, masters, optimizer)
    dcp.load(state, checkpoint_id=path)
    groups = state["optim"]["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"load: the checkpoint's optimizer has {len(groups)} parameter groups, "
                         f"this one {len(optimizer.param_groups)}")  # fmt: skip
    model.load_state_dict(state["model"])
    if isinstance(masters, ShardedMasterWeights):
        masters.scale.copy_(state["scales"])
        for name, m in zip(masters.piece_names, masters.masters, strict=True):
            _copy_pieces(m, state["masters"][name])
        names = {id(m): n for n, m in zip(masters.piece_names, masters.masters, strict=True)}
    else:
        masters.load_state_dict({"masters": state["masters"]})
        names = _names(model, masters)
    opt_state = state["optim"]["state"]
    for p in list(optimizer.state):
        for key, value in opt_state[names[id(p)]].items():
            current = optimizer.state[p].get(key)
            if hasattr(value, "local_shards"):
                _copy_pieces(current, value)
            elif not (torch.is_tensor(value) and value is current):
                optimizer.state[p][key] = value
    for g, saved in zip(optimizer.param_groups, state["optim"]["param_groups"].values(),
                        strict=True):  # fmt: skip
        g.update({k: v for k, v in saved.items() if k != "params" and not torch.is_tensor(v)})
    masters.write_back_()


def _copy_pieces(dst: torch.Tensor, sharded) -> None:
    """This rank's piece of a 1-D ShardedTensor into `dst` (the piece, the same elements)."""
    (shard,) = sharded.local_shards()
    dst.copy_(shard.tensor)
