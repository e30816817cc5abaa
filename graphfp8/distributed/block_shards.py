"""Blockwise FP8 weights (Float8BlockTensor) under sharded masters: each rank quantizes the
128x128 blocks of its own fp32 slice, then the FP8 bytes and the block scales are all-gathered.

The shard layout (shard_layout.py) puts every blockwise weight and every rank's slice on 128-row
stripes (128 * K elements), so a piece is whole stripes of whole blocks and each block's scale
comes from its own amax on the one rank that holds it: no amax all-reduce, and the blocks are
bit for bit those an unsharded MasterWeights writes (graphfp8.fp8.primary.BlockWeightQuantizer).
Per bucket of such weights a float32 buffer holds the block scales, ceil(K / 128) per stripe in
the order of the stripes; each weight's `_scale_inv` becomes a (ceil(N / 128), ceil(K / 128))
view of it, rank r's scales are its stripes' (docs/sharding.md, "Blockwise FP8 weights").
"""

from __future__ import annotations

import torch

from graphfp8.distributed.collectives import all_gather_
from graphfp8.distributed.shard_layout import BLOCK, Bucket, Piece, ShardLayout
from graphfp8.ops.blockwise import quantize_blocks

__all__ = ["BlockShards"]


def _k_tiles(bucket: Bucket) -> int:
    """ceil(K / 128): block scales per stripe of the bucket's weights."""
    return -(-bucket.stripe // BLOCK // BLOCK)


class BlockShards:
    """The block-scale buffers of a sharded model's blockwise FP8 weights and their write-back.

    Args:
        layout: the masters' shard layout; by_name: {name: parameter} (its blockwise weights
            get their `_scale_inv` replaced by views of the buffers, values kept).
        device: where the buffers live.
    """

    def __init__(self, layout: ShardLayout, by_name: dict, device) -> None:
        self.layout = layout
        self.scales: dict[int, torch.Tensor] = {}  # bucket index -> (stripes * k_tiles,) fp32
        for b, bucket in enumerate(layout.buckets):
            if not bucket.stripe:
                continue
            kt = _k_tiles(bucket)
            flat = torch.ones(bucket.padded(layout.world) // bucket.stripe * kt,
                              dtype=torch.float32, device=device)  # fmt: skip
            for e in bucket.entries:
                p = by_name[e.name]
                first = e.offset // bucket.stripe * kt
                view = flat[first : first + p._scale_inv.numel()].view(p._scale_inv.shape)
                view.copy_(p._scale_inv)
                old, p._scale_inv = p._scale_inv, view
                old.set_()  # freed, as the FP8 data (sharded_masters._build_buffers)
            self.scales[b] = flat
        # Each weight's power_2_scale is read at every write-back: a checkpoint's blocks loaded
        # into it bring theirs (fp8/block_tensor.py, copy_).
        self.weights = {e.name: by_name[e.name] for b in self.scales
                        for e in layout.buckets[b].entries}  # fmt: skip

    def is_block(self, piece: Piece) -> bool:
        return piece.bucket in self.scales

    def quantize_(self, pieces: list[tuple[Piece, torch.Tensor]], flats: list) -> None:
        """Each blockwise piece's blocks from its fp32 master into the FP8 bytes and scales.

        Args:
            pieces: (layout piece, its fp32 master (stop - start,)) of this rank's blockwise
                pieces; flats: the masters' uint8 buffers, one per bucket.
        """
        for piece, master in pieces:
            bucket, e = self.layout.buckets[piece.bucket], piece.entry
            k = e.shape[1]
            hp = master.view(-1, k)
            data, scale_inv = quantize_blocks(hp, e.fp8_dtype, self.weights[e.name]._power_2_scale)
            flats[piece.bucket][piece.start : piece.stop].view(e.fp8_dtype).copy_(data.view(-1))
            first = piece.start // bucket.stripe * _k_tiles(bucket)
            self.scales[piece.bucket][first : first + scale_inv.numel()].copy_(scale_inv.view(-1))

    def gather_(self, group) -> None:
        """Every rank's block scales to every rank (one all-gather per bucket)."""
        rank = self.layout.rank
        for flat in self.scales.values():
            per_rank = flat.numel() // self.layout.world
            all_gather_(flat, flat[rank * per_rank : (rank + 1) * per_rank], group)

    def tensors(self) -> list[torch.Tensor]:
        """The scale buffers (a model change since the last write-back shows in them)."""
        return list(self.scales.values())
