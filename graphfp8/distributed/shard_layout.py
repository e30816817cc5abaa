"""Where every trainable parameter lives in the flat buffers of sharded masters
(sharded_masters.py).

Parameters are grouped by kind - FP8 primary weights per (FP8 dtype, nominal dtype), the others
per dtype - and, in model order, cut into buckets of at most `bucket_bytes` of gradient. In a
bucket each parameter starts at a multiple of ALIGN elements (16-byte FP8 data for the GEMMs and
vector loads; slices that start aligned), and the bucket is padded to N * S elements, S a multiple
of ALIGN: rank r owns elements [r * S, (r + 1) * S) of the bucket - its slice of the fp32
masters, of their gradients and of the optimizer state. A piece is one parameter's part of one
rank's slice (none when they do not meet: a parameter smaller than a slice lies on one or two
ranks only). Padding and gaps hold zeros that no optimizer sees.

Blockwise FP8 weights (Float8BlockTensor: 128x128 blocks) are bucketed per in-features K, each
starting at a multiple of a 128-row stripe (128 * K elements) and with a slice S a multiple of
it too, so every piece is whole stripes of whole 128x128 blocks: each rank quantizes its own
blocks from its fp32 slice with no amax all-reduce (block_shards.py). Padding to whole stripes
costs at most one stripe per weight and per rank.

ALIGN also keeps the optimizer's arithmetic independent of the split: torch's fused CPU AdamW
rounds its vector loop and its scalar tail differently (1 ulp, torch 2.13), so a piece that
starts off a multiple of the vector width would step some elements unlike the whole parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.ops.blockwise import TILE as BLOCK

__all__ = ["ALIGN", "Bucket", "Entry", "Piece", "ShardLayout"]

ALIGN = 16  # elements


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class Entry:
    """One parameter in its bucket: elements [offset, offset + numel) of the bucket."""

    name: str
    shape: tuple[int, ...]
    offset: int
    fp8_dtype: torch.dtype | None  # None: a high-precision parameter
    dtype: torch.dtype  # the parameter's (nominal) dtype, which its gradient has

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """Entry `entry` of bucket `bucket` meets this rank's slice in the bucket's elements
    [start, stop): elements [start - entry.offset, stop - entry.offset) of the flat parameter."""

    bucket: int
    entry: Entry
    start: int
    stop: int


@dataclass(frozen=True)
class Bucket:
    """Parameters of one kind, flat: `size` elements used, `shard` per rank (N * shard total).
    `stripe`: for blockwise FP8 weights, 128 * K (entries and shards fall on stripes), else 0."""

    entries: tuple[Entry, ...]
    size: int
    shard: int
    fp8_dtype: torch.dtype | None
    dtype: torch.dtype
    stripe: int = 0

    def padded(self, world: int) -> int:
        return self.shard * world


def _kind(p: torch.Tensor) -> tuple:
    fp8 = getattr(p, "fp8_dtype", None)  # a Float8Tensor (graphfp8.fp8.tensor)
    return (fp8, p.dtype)


def _stripe(p: torch.Tensor) -> int:
    """128 * K for a blockwise FP8 weight (N, K) (its 128-row stripe of blocks), else 0."""
    return BLOCK * p.shape[1] if isinstance(p, Float8BlockTensor) else 0


class ShardLayout:
    """The buckets of `named` parameters over `world` ranks, and this rank's pieces.

    Args:
        named: (name, parameter) pairs, model order, each parameter once.
        world: N, the shard group's size; rank: this process's rank in it.
        bucket_bytes: the most gradient bytes of one bucket (a larger parameter gets its own).
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]], world: int, rank: int,
                 bucket_bytes: int) -> None:  # fmt: skip
        self.world, self.rank = world, rank
        runs: dict[tuple, list[list[tuple[str, torch.Tensor]]]] = {}
        used: dict[tuple, int] = {}
        for name, p in named:
            kind, nbytes = (*_kind(p), _stripe(p)), p.numel() * p.element_size()
            bucket_runs = runs.setdefault(kind, [[]])
            if bucket_runs[-1] and used[kind] + nbytes > bucket_bytes:
                bucket_runs.append([])
                used[kind] = 0
            bucket_runs[-1].append((name, p))
            used[kind] = used.get(kind, 0) + nbytes
        self.buckets = [self._bucket(run) for kind_runs in runs.values() for run in kind_runs]
        self.pieces = [
            Piece(b, e, max(e.offset, lo), min(e.stop, hi))
            for b, bucket in enumerate(self.buckets)
            for lo, hi in [(rank * bucket.shard, (rank + 1) * bucket.shard)]
            for e in bucket.entries
            if max(e.offset, lo) < min(e.stop, hi)
        ]

    def _bucket(self, run: list[tuple[str, torch.Tensor]]) -> Bucket:
        stripe = _stripe(run[0][1])
        unit = stripe or ALIGN  # a stripe is a multiple of ALIGN
        entries, offset = [], 0
        for name, p in run:
            fp8, dtype = _kind(p)
            entries.append(Entry(name, tuple(p.shape), offset, fp8, dtype))
            offset = _round_up(offset + p.numel(), unit)
        shard = _round_up(-(-offset // self.world), unit)
        return Bucket(tuple(entries), offset, shard, *_kind(run[0][1]), stripe)

    def local_numel(self) -> int:
        """Elements of this rank's pieces (what its optimizer steps)."""
        return sum(p.stop - p.start for p in self.pieces)

    def describe(self) -> dict:
        """The layout as plain values (a checkpoint records it; a resume compares it): the same
        on every rank but for "rank"."""
        return {
            "world": self.world,
            "rank": self.rank,
            "align": ALIGN,
            "buckets": [
                {
                    "shard": b.shard,
                    **({"stripe": b.stripe} if b.stripe else {}),
                    "entries": [
                        [e.name, list(e.shape), e.offset, str(e.fp8_dtype), str(e.dtype)]
                        for e in b.entries
                    ],  # fmt: skip
                }
                for b in self.buckets
            ],
        }
