"""The collectives of sharded training (sharded_masters.py): reduce-scatter and all-gather of
flat buffers, one MAX all-reduce of a vector, through torch.distributed's single-tensor forms.

`reduce_scatter_single` / `all_gather_single` are the forms torch 2.13 keeps
(`reduce_scatter_tensor` / `all_gather_into_tensor` now warn that they are deprecated and call
them); both run on gloo (CPU) and NCCL. torch 2.11 (the H200's) has only the older names, which
`_single` falls back to. FP8 buffers travel as uint8: gloo refuses float8 dtypes
("Invalid scalar type"), and bytes are what an all-gather moves anyway. Each call waits as the
blocking torch.distributed call does (a NCCL one: the current stream waits, so a CUDA graph
captures it; on the CPU tape, graphs/tape.py replays it like eager).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_", "max_all_reduce_", "reduce_scatter_", "wire_view"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# torch >= 2.13 names them *_single and deprecates the old names; torch 2.11 has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as it goes over the wire: FP8 as uint8 (the same bytes), anything else as is."""
    return t.view(torch.uint8) if t.dtype in _FP8 else t


def reduce_scatter_(shard: torch.Tensor, flat: torch.Tensor, group) -> None:
    """shard <- this rank's slice of the sum of every rank's `flat`.

    Args:
        shard: (S,) contiguous, written.
        flat: (N * S,) contiguous, the same dtype; N the group's size; read only.
        group: the torch.distributed group.
    """
    _reduce_scatter(shard, flat, group=group)


def all_gather_(flat: torch.Tensor, shard: torch.Tensor, group) -> None:
    """flat <- every rank's `shard`, in rank order (in place when `shard` is this rank's slice of
    `flat`).

    Args:
        flat: (N * S,) contiguous, written; FP8 or any dtype.
        shard: (S,) contiguous, flat's dtype.
        group: the torch.distributed group.
    """
    _all_gather(wire_view(flat), wire_view(shard), group=group)


def max_all_reduce_(t: torch.Tensor, group) -> None:
    """t <- the elementwise maximum of every rank's t (float32 amaxes)."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
