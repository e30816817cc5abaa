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
import weakref
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "DistInfo",
    "SettingsMismatchError",
    "allreduce_gradients",
    "check_gradient_layout",
    "check_same_settings",
    "cleanup",
    "gather_objects",
    "init_distributed",
    "is_distributed",
    "mark_sharded",
]

# Gradients ------------------------------------------------------------------------------------

# {tensor: what reduces its gradients itself} (sharded_masters.py's masters reduce-scatter them).
_SHARDED = WeakIdKeyDictionary()


def mark_sharded(tensors, owner: str) -> None:
    """Marks tensors whose gradients `owner` reduces (sharded masters): allreduce_gradients
    refuses them, which would reduce the gradients twice."""
    for t in tensors:
        _SHARDED[t] = owner


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
    parameters,
    group=None,
    average: bool = True,
    bucket_mb: float = 25.0,
    check_every_step: bool = True,
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
            `.grad` are skipped, which every rank must agree on: check_gradient_layout
            raises on every rank otherwise. Duplicates count once.
        group: the torch.distributed group (None: the default group).
        average: divide the sum by the group's size, as DDP does.
        bucket_mb: largest bucket, in MiB.
        check_every_step: check the ranks' gradients on every call (one all_gather of 3
            integers, and with NCCL a host sync). False checks each gradient set once and then
            costs nothing, but cannot catch a rank whose set changes alone (a parameter that
            stops being used on one rank): that rank's check meets the others' all-reduce.
            Graph captures never check (their warmup did, on the same gradients).
    """
    parameters = list(parameters)
    owners = {_SHARDED[p] for p in parameters if p in _SHARDED}
    if owners:
        raise RuntimeError(
            f"allreduce_gradients: these gradients are reduced by {sorted(owners)} (sharded "
            "masters reduce-scatter them in clip_grad_norm_ / step); all-reducing them too "
            "would reduce them twice"
        )
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    seen, grads, layout = set(), [], []
    for i, p in enumerate(parameters):
        if p.grad is None or id(p) in seen:
            continue
        if p.grad.is_sparse:
            raise ValueError("allreduce_gradients: sparse gradients are not supported")
        seen.add(id(p))
        grads.append(p.grad)
        layout.append((i, tuple(p.grad.shape), p.grad.dtype))
    bucket_bytes = int(bucket_mb * 2**20)
    check_gradient_layout(layout, (bucket_bytes, bool(average)), group, check_every_step)
    size = dist.get_world_size(group)
    pending = []
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        if average:
            flat.div_(size)
        for g, chunk in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(chunk.view_as(g))


# The cross-rank check before the all-reduce ---------------------------------------------------

# {group: this process's hashes of the gradient layouts that every rank was found to share}
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_gradient_layout(
    layout: list[tuple], settings: tuple, group=None, every_call: bool = True
) -> None:
    """Checks that every rank of `group` is about to all-reduce the same gradients: otherwise
    the flat buckets differ in size, gloo aborts the process (SIGABRT) and NCCL hangs or mixes
    unrelated gradients. A collective (an all_gather of 3 integers; the layouts themselves only
    when they differ): every rank must call it, with the same `every_call`.

    Args:
        layout: (index in the parameters iterable, shape, dtype) of each gradient, in order.
        settings: (bucket bytes, average), which every rank must share too.
        group: the process group (None: the default group).
        every_call: check on every call; False: once per layout (see allreduce_gradients).

    Raises:
        RuntimeError: on every rank, naming the parameters whose gradients differ.
    """
    key = group if group is not None else dist.group.WORLD
    local = hash((tuple(layout), settings))  # this process's key: one tuple hash per call
    if not every_call and local in _CHECKED.get(key, ()):
        return
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if capturing or torch._C._len_torch_dispatch_stack():
        return  # a capture (graphfp8's tape records through a dispatch mode) cannot sync
    layout = [(i, shape, str(dtype)) for i, shape, dtype in layout]
    text = repr((layout, settings)).encode()  # the same bytes on every rank that agrees
    crc = zlib.crc32(text)
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([len(layout), len(text), crc], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    if any(not torch.equal(r, rows[0]) for r in rows):
        layouts = gather_objects((layout, settings), group)
        raise RuntimeError(
            "graphfp8.allreduce_gradients: the ranks hold different gradients, so their "
            "all-reduce would abort or mix unrelated values (a parameter unused on one rank? "
            "give it a zero grad, or leave it out of the parameters on every rank): "
            + "; ".join(_layout_differences(layouts))
        )
    _CHECKED.setdefault(key, set()).add(local)


def _layout_differences(layouts: list[tuple]) -> list[str]:
    """One line per rank and difference from group rank 0."""
    (base, base_settings), lines = layouts[0], []
    base_grads = {i: rest for i, *rest in base}
    for rank, (layout, settings) in enumerate(layouts[1:], start=1):
        if settings != base_settings:
            lines.append(f"rank {rank} has (bucket bytes, average) {settings}, rank 0 "
                         f"{base_settings}")  # fmt: skip
        grads = {i: rest for i, *rest in layout}
        for i in sorted(set(grads) | set(base_grads)):
            theirs, ours = grads.get(i), base_grads.get(i)
            if theirs == ours:
                continue
            if theirs is None or ours is None:
                has, lacks = (0, rank) if theirs is None else (rank, 0)
                lines.append(f"parameter {i} ({_text(ours or theirs)}) has a gradient on rank "
                             f"{has}, none on rank {lacks}")  # fmt: skip
            else:
                lines.append(f"parameter {i} has a {_text(ours)} gradient on rank 0, a "
                             f"{_text(theirs)} one on rank {rank}")  # fmt: skip
    return lines


def _text(shape_dtype) -> str:
    shape, dtype = shape_dtype
    return f"{tuple(shape)} {dtype}"


# Settings ---------------------------------------------------------------------------------------


class SettingsMismatchError(RuntimeError):
    """The ranks of a data-parallel run were started with different settings."""


def gather_objects(value, group=None) -> list:
    """Every rank's `value` (picklable) in rank order: all_gather_object as a return value. A
    collective: every rank of `group` must call it."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def check_same_settings(settings: dict, group=None) -> None:
    """Checks that every rank of `group` holds the same `settings` (a dict of picklable values
    compared with ==), e.g. a training run's command-line options before it starts. A
    collective (all_gather_object): every rank must call it; a no-op outside a process group.

    Raises:
        SettingsMismatchError: on every rank, naming each setting that differs from rank 0's.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    rows = gather_objects(settings, group)
    diff = []
    for rank, row in enumerate(rows[1:], start=1):
        for k in sorted(set(row) | set(rows[0])):
            if row.get(k) != rows[0].get(k):
                diff.append(f"{k}: rank 0 {rows[0].get(k)!r}, rank {rank} {row.get(k)!r}")
    if diff:
        raise SettingsMismatchError(
            "the ranks were started with different settings (every rank must run the same "
            "command): " + "; ".join(diff)
        )


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
