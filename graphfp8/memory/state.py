"""Bytes per parameter per GPU: the persistent training state one rank holds - weights (FP8 data,
transpose and scale_inv of FP8 primary weights), the FP8 casts of high-precision weights, the
model's gradients, fp32 masters and their gradients (all of them, or this rank's slices when
sharded), the optimizer state - each storage counted once, divided by the model's parameter count.
Activations, graph pools and collectives' buffers are not state (graphfp8.memory.memory_report
and torch.cuda's counters measure those)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from graphfp8.distributed.shard_layout import ShardLayout
from graphfp8.memory.ledger import Ledger
from graphfp8.modules.base import FP8Module

__all__ = ["STATE_CATEGORIES", "TrainingState", "sharded_at", "training_state"]

WEIGHTS, FP8_CASTS, GRADS = "weights", "FP8 weight casts", "grads"
MASTERS, MASTER_GRADS, OPTIMIZER = "fp32 masters", "master grads", "optimizer state"
STATE_CATEGORIES = (WEIGHTS, FP8_CASTS, GRADS, MASTERS, MASTER_GRADS, OPTIMIZER)


@dataclass
class TrainingState:
    """Bytes of one rank's persistent training state by category, and the model's parameters.

    Attributes:
        bytes: {category: bytes}, categories in STATE_CATEGORIES order.
        parameters: elements of the model's parameters (the whole model, on every rank).
    """

    bytes: dict[str, int] = field(default_factory=dict)
    parameters: int = 0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def per_parameter(self) -> dict[str, float]:
        """{category: bytes per parameter, ..., "total": ...}."""
        out = {k: v / self.parameters for k, v in self.bytes.items()}
        out["total"] = self.total / self.parameters
        return out

    def to_dict(self) -> dict:
        return {"bytes": dict(self.bytes), "parameters": self.parameters, "total": self.total,
                "bytes_per_parameter": self.per_parameter()}  # fmt: skip


def _fp8_casts(model: nn.Module):
    """The FP8 weight workspaces of graphfp8 layers (the casts of high-precision weights)."""
    for module in model.modules():
        if isinstance(module, FP8Module):
            yield from module.weight_cache.workspaces.values()


def _grads(model: nn.Module):
    """The parameters' .grad and a graphed run's persistent .grad buffers."""
    for p in model.parameters():
        yield p.grad
        yield getattr(p, "_graphfp8_grad", None)


def _master_tensors(masters):
    """(masters, their gradients) of a MasterWeights, sharded or not."""
    return masters.master_tensors() if masters is not None else ([], [])


def training_state(model: nn.Module, optimizer=None, masters=None) -> TrainingState:
    """The persistent training state this process holds for `model`.

    Args:
        model: the model (its parameters and gradients; graphfp8 layers' FP8 weight casts).
        optimizer: its torch optimizer (every tensor of optimizer.state), or None.
        masters: its graphfp8.MasterWeights (sharded or not), or None.
    """
    ledger = Ledger()
    master_values, master_grads = _master_tensors(masters)
    optimizer_state = []
    if optimizer is not None:
        for s in optimizer.state.values():
            optimizer_state += [v for v in s.values() if isinstance(v, torch.Tensor)]
    sources = (
        (WEIGHTS, model.parameters()),
        (FP8_CASTS, _fp8_casts(model)),
        (GRADS, _grads(model)),
        (MASTERS, master_values),
        (MASTER_GRADS, master_grads),
        (OPTIMIZER, optimizer_state),
    )
    for category, tensors in sources:
        for t in tensors:
            if t is not None:
                ledger.claim(t, category, category)
    return TrainingState({c: ledger.bytes[c] for c in STATE_CATEGORIES},
                         sum(p.numel() for p in model.parameters()))  # fmt: skip


def sharded_at(state: TrainingState, masters, world: int) -> TrainingState:
    """The state of the rank holding the most at another group size: what `state` (measured
    with sharded `masters`) would be with `world` ranks. Weights, FP8 weight casts and grads are
    replicated (as measured, the flat buffers' padding for `world` ranks); the fp32 masters and
    their gradients are the padded slices (4 bytes per element each); the optimizer state scales
    with the elements of the rank's pieces (AdamW: two fp32 moments; its step counts, one per
    piece, are counted as measured)."""
    named = list(zip(masters.names, masters.params, strict=True))
    layouts = [ShardLayout(named, world, r, masters.bucket_bytes) for r in range(world)]
    slices = sum(b.shard for b in layouts[0].buckets)
    local = max(layout.local_numel() for layout in layouts)
    measured = masters.layout.local_numel()
    out = TrainingState(dict(state.bytes), state.parameters)
    for now, then in zip(masters.layout.buckets, layouts[0].buckets, strict=True):
        size = 1 if now.fp8_dtype is not None else now.dtype.itemsize  # FP8 flats hold bytes
        out.bytes[WEIGHTS] += (then.padded(world) - now.padded(masters.world)) * size
    out.bytes[MASTERS] = out.bytes[MASTER_GRADS] = 4 * slices
    out.bytes[OPTIMIZER] = round(state.bytes[OPTIMIZER] * local / measured)
    return out
