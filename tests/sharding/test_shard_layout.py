"""The flat layout of sharded masters (no ranks needed): buckets by kind and size, aligned entries,
equal slices, and pieces that cover every element of every parameter exactly once over the
ranks - uneven sizes, a parameter smaller than N."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.distributed.shard_layout import ALIGN, ShardLayout
from tests.sharding.common import build_lm


def _named(fp8_weights: bool):
    return [(n, p) for n, p in build_lm("cpu", fp8_weights).named_parameters()]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("bucket_bytes", [1, 2048, 2**20])
def test_pieces_cover_every_element_once(world, bucket_bytes):
    named = _named(True)
    layouts = [ShardLayout(named, world, r, bucket_bytes) for r in range(world)]
    covered = {n: torch.zeros(p.numel(), dtype=torch.int64) for n, p in named}
    for layout in layouts:
        for piece in layout.pieces:
            e = piece.entry
            assert piece.start % ALIGN == 0 and e.offset % ALIGN == 0
            covered[e.name][piece.start - e.offset : piece.stop - e.offset] += 1
        assert layout.describe() | {"rank": 0} == layouts[0].describe()
    assert all(bool((c == 1).all()) for c in covered.values())
    for b in layouts[0].buckets:
        assert b.shard % ALIGN == 0 and b.padded(world) >= b.size
        kinds = {(e.fp8_dtype, e.dtype) for e in b.entries}
        assert kinds == {(b.fp8_dtype, b.dtype)}
        if bucket_bytes == 1:
            assert len(b.entries) == 1  # every parameter larger than a bucket: its own
    gain = [p for layout in layouts for p in layout.pieces if p.entry.name == "gain"]
    assert len(gain) == 1  # 2 elements: one rank


def test_fp8_and_high_precision_parameters_get_their_own_buckets():
    layout = ShardLayout(_named(True), 2, 0, 2**20)
    kinds = [(b.fp8_dtype, b.dtype) for b in layout.buckets]
    assert kinds == [(None, torch.float32), (torch.float8_e4m3fn, torch.float32)]  # first seen
    fp8 = {e.name for e in layout.buckets[1].entries}
    assert fp8 == {"block.qkv.weight", "block.proj.weight", "block.mlp.fc1_weight",
                   "block.mlp.fc2_weight", "head.weight"}  # fmt: skip
    assert isinstance(dict(_named(True))["head.weight"], g8.Float8Tensor)
