"""Data parallel: gradient all-reduce and torchrun init (the amax reduction lives with the arenas).

How often the amax MAX all-reduce runs: with every scale update, i.e. once per microbatch per
direction - in the forward arena update (entering each fp8_autocast region eagerly, the start
of the first callable's forward graph when graphed) and in the backward arena update (the end of
each backward pass, the end of the last backward graph). In graphfp8's delayed scaling every
microbatch is one scale-update step: the update consumes row 0 of the amax history (it rolls
into the history and sets the next microbatch's scales), so the ranks must agree on row 0 at each
update, or their scales - and with them the FP8 weights they compute with - drift apart. The
collective is one (num_slots,) float32 tensor per arena: latency, not bandwidth. It and the
setup check before it live with the arenas (graphfp8.fp8.scaling, graphfp8.fp8.arena_check):
this module depends on nothing of the FP8 layer.

Gradients are another matter: graphed callables fold parameter gradients into `.grad` inside
captured graphs, without autograd's AccumulateGrad, so DistributedDataParallel (whose reducer
hooks AccumulateGrad) never sees them. `allreduce_gradients` is the explicit replacement: call it
once per optimizer step, after the last microbatch's backward (DDP's no_sync semantics: no
communication per microbatch).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "allreduce_gradients", "cleanup", "init_distributed", "is_distributed"]

# Gradients ------------------------------------------------------------------------------------


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Splits grads, in order, into runs of one (device, dtype) of at most bucket_bytes each (a
    single larger gradient gets a bucket of its own)."""
    by_kind: dict[tuple, list[list[torch.Tensor]]] = {}
    sizes: dict[tuple, int] = {}
    for g in grads:
        kind = (g.device, g.dtype)
        nbytes = g.numel() * g.element_size()
        runs = by_kind.setdefault(kind, [[]])
        if runs[-1] and sizes[kind] + nbytes > bucket_bytes:
            runs.append([])
            sizes[kind] = 0
        runs[-1].append(g)
        sizes[kind] = sizes.get(kind, 0) + nbytes
    return [run for runs in by_kind.values() for run in runs]


def allreduce_gradients(
    parameters, group=None, average: bool = True, bucket_mb: float = 25.0
) -> None:
    """Sums (or averages) the parameters' `.grad` over the ranks of `group`, in place.

    Call it once per optimizer step, after the backward of the last microbatch and before
    `optimizer.step()`: gradients accumulate locally over the microbatches (DDP's no_sync), then
    one bucketed all-reduce synchronises them. Works for eager modules and graphed callables
    alike; DistributedDataParallel does not see graphed gradients (they bypass AccumulateGrad,
    which its reducer hooks). Each bucket holds gradients of one device and dtype, flattened into
    one contiguous tensor, all-reduced (all buckets in flight at once) and copied back.

    Args:
        parameters: an iterable of parameters (e.g. `model.parameters()`); those without a
            `.grad` are skipped, which every rank must agree on. Duplicates count once.
        group: the torch.distributed group (None: the default group).
        average: divide the sum by the group's size, as DDP does.
        bucket_mb: largest bucket, in MiB.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    seen, grads = set(), []
    for p in parameters:
        if p.grad is None or id(p) in seen:
            continue
        if p.grad.is_sparse:
            raise ValueError("allreduce_gradients: sparse gradients are not supported")
        seen.add(id(p))
        grads.append(p.grad)
    size = dist.get_world_size(group)
    pending = []
    for bucket in _buckets(grads, int(bucket_mb * 2**20)):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        if average:
            flat.div_(size)
        for g, chunk in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(chunk.view_as(g))


# Process group setup ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its global rank, the world size, its rank on this node and the
    device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(device_type: str = "cuda", timeout_s: float = 600.0) -> DistInfo:
    """Joins the default process group from torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT): NCCL on `cuda:LOCAL_RANK` (made the current device),
    gloo on the CPU. Without WORLD_SIZE (a plain `python` run) it starts nothing and returns a
    world of one. Calling it again returns the same answer.

    Args:
        device_type: "cuda" or "cpu".
        timeout_s: how long a collective may wait before failing instead of hanging.

    Returns:
        DistInfo(rank, world_size, local_rank, device).
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(
            f"init_distributed: device_type must be 'cuda' or 'cpu', got {device_type!r}"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(0, 1, 0, device)
    if not dist.is_initialized():
        # device_id makes NCCL create its communicator now: a CUDA graph cannot capture that.
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def cleanup() -> None:
    """Leaves the default process group, if this process joined one.

    Drop the graphed callables first: a captured graph (a CPU tape) holds the process group,
    and a group that outlives destroy_process_group is destroyed during interpreter shutdown,
    where gloo was seen to abort ("terminate called without an active exception"). The garbage
    collection here frees graphs that only reference cycles still hold. (The arenas' setup-check
    cache holds groups weakly.)
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
