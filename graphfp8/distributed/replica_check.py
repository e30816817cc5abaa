"""graphfp8-train --check-replicas: the model's weights identical on every rank after every step.

After each optimizer step every rank takes a digest of the bits of each parameter (FP8 primary
weights: their FP8 bytes and scale_inv) and all-gathers the digests; at the next log point
(already a host sync) the ranks compare them, and any difference stops the run on every rank with
the step, the tensors and the ranks that differ (docs/sharding.md, "Multi-GPU measurement"). The
digests of rank 0 are kept per step, so that two runs (eager and step graph, sharded and
unsharded) can be compared weight for weight afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from graphfp8.distributed.collectives import all_gather_
from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["ReplicaCheck", "ReplicaMismatchError", "digest"]

_STRIDE = 61  # positions are told apart modulo this prime (two swapped words change the digest)
_SHOWN = 5  # differing tensors named in the error


class ReplicaMismatchError(RuntimeError):
    """The ranks' replicated weights differ."""


def _words(t: torch.Tensor) -> torch.Tensor:
    """t's bits as a 1-D integer tensor: int32 words when its bytes allow, else bytes."""
    flat = t.detach().reshape(-1)
    if flat.stride(0) != 1:  # a one-element view of a larger tensor keeps its stride
        flat = torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    raw = flat.view(torch.uint8)
    if raw.numel() % 4 == 0 and raw.data_ptr() % 4 == 0:
        return raw.view(torch.int32)
    return raw


def digest(t: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers of t's bits: the sum of its words, and the sums of the words at the
    positions of each residue modulo 61 weighted by residue + 1. Any change of one word changes
    the first; swapping two words at different residues changes the second.

    Args:
        t: any dense contiguous tensor (a parameter, FP8 bytes, a scale).

    Returns:
        (2,) int64 on t's device (wrapping on overflow, the same on every rank).
    """
    words = _words(t)
    whole = words.numel() - words.numel() % _STRIDE
    columns = words[:whole].view(-1, _STRIDE).sum(0, dtype=torch.int64)
    weights = torch.arange(1, _STRIDE + 1, dtype=torch.int64, device=words.device)
    return torch.stack([words.sum(dtype=torch.int64), (columns * weights).sum()])


def _named_bits(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter's bits, an FP8 primary weight's as its data and its
    scale_inv. (The FP8 scales are compared once, at the end of a run: training/loop.py's
    ranks_agree; modules allocate them at their first FP8 forward.)"""
    out = []
    for name, p in model.named_parameters():
        if isinstance(p, Float8Tensor):
            out += [(name, p._data), (f"{name}.scale_inv", p._scale_inv)]
        else:
            out.append((name, p))
    return out


class ReplicaCheck:
    """Per-step digests of one rank's replicated weights, gathered from every rank of `group`.

    Args:
        model: the replicated model (each rank its copy).
        group: the torch.distributed group of the replicas.
    """

    def __init__(self, model: nn.Module, group):
        self.model, self.group = model, group
        self.world = dist.get_world_size(group)
        self.names = [name for name, _ in _named_bits(model)]
        self.steps_checked = 0
        self.step_digests: list[int] = []  # rank 0's digest of the whole model, per step
        self._pending: list[tuple[int, torch.Tensor]] = []

    def record(self, step: int) -> None:
        """Digests the weights after `step` and all-gathers them (no host sync)."""
        bits = _named_bits(self.model)
        if [name for name, _ in bits] != self.names:
            raise ReplicaMismatchError(f"the model's parameters changed before step {step}")
        mine = torch.stack([digest(t) for _, t in bits]).reshape(-1)
        every = torch.empty(self.world * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_(every, mine, self.group)
        self._pending.append((step, every.view(self.world, len(bits), 2)))

    def check(self) -> None:
        """Compares the digests recorded since the last check (one host sync); raises
        ReplicaMismatchError, on every rank alike, at the first step where a rank differs."""
        if not self._pending:
            return
        steps = [s for s, _ in self._pending]
        every = torch.stack([g for _, g in self._pending]).cpu()  # (steps, world, tensors, 2)
        self._pending.clear()
        differs = (every != every[:, :1]).any(dim=3)  # (steps, world, tensors)
        for i, step in enumerate(steps):
            if differs[i].any():
                raise ReplicaMismatchError(self._describe(step, differs[i]))
            self.step_digests.append(_fold(every[i, 0]))
            self.steps_checked += 1

    def _describe(self, step: int, differs: torch.Tensor) -> str:
        ranks = [r for r in range(self.world) if differs[r].any()]
        tensors = [self.names[t] for t in differs.any(dim=0).nonzero().flatten().tolist()]
        shown = ", ".join(tensors[:_SHOWN]) + (f" and {len(tensors) - _SHOWN} more"
                                               if len(tensors) > _SHOWN else "")  # fmt: skip
        when = "at the start" if step == 0 else f"after step {step}"
        return (
            f"--check-replicas: the weights differ across ranks {when}: rank(s) {ranks} "
            f"differ from rank 0 in {len(tensors)} tensor(s): {shown}"
        )

    def summary(self) -> dict:
        """{"steps_checked", "identical": True (a mismatch raised), "step_digests"}."""
        return {"steps_checked": self.steps_checked, "identical": True,
                "step_digests": list(self.step_digests)}  # fmt: skip


def _fold(digests: torch.Tensor) -> int:
    """One int64 of a rank's (tensors, 2) digests, order-sensitive (wrapping)."""
    weights = torch.arange(1, digests.numel() + 1, dtype=torch.int64)
    return int((digests.reshape(-1) * weights).sum())
