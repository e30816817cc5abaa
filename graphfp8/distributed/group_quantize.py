"""FP8 weights quantized from fp32 pieces spread over ranks, one amax per weight over all of them:
what sharded masters (sharded_masters.py) and masters under FSDP2 (fsdp_masters.py) write back.

Per weight: the amax of each local piece, one MAX all-reduce of the vector of per-weight amaxes
for all weights at once, the scale from it (current scaling of the weight: fp8_max / amax, kept
when the amax is 0 - the update graphfp8.fp8.primary.WeightQuantizer runs for one weight),
scale_inv = 1 / scale for every weight in one launch, then each piece cast with its weight's
scale. An amax is a maximum, exact over any split, so every piece is quantized exactly as the
whole weight would be on one rank. Everything is persistent device buffers and kernels: a step
graph captures it.
"""

from __future__ import annotations

import torch

from graphfp8 import ops
from graphfp8.distributed.collectives import max_all_reduce_
from graphfp8.fp8.recipe import fp8_max

__all__ = ["GroupQuantizer"]


class GroupQuantizer:
    """Buffers of W FP8 weights' quantization.

    Attributes:
        amax, scale, scaled_max: (W,) float32.
        scale_inv: (W,) float32, every 4th float of its storage, so that each weight's
            `scale_inv[i : i + 1]` starts 16-byte aligned (cuBLASLt's FP8 GEMMs need it).
    """

    def __init__(self, fp8_dtypes: list[torch.dtype], device) -> None:
        w = len(fp8_dtypes)
        self.amax = torch.zeros(w, dtype=torch.float32, device=device)
        self.scale = torch.ones(w, dtype=torch.float32, device=device)
        self.scale_inv = torch.ones(4 * w, dtype=torch.float32, device=device)[::4]
        maxes = [fp8_max(d) for d in fp8_dtypes]
        self.scaled_max = torch.tensor(maxes, dtype=torch.float32, device=device)
        self.sink = torch.zeros(2, dtype=torch.float32, device=device)  # what casts write besides

    def quantize_(self, pieces: list[tuple[int, torch.Tensor, torch.Tensor]], group) -> None:
        """Quantizes every piece with its weight's scale over the ranks of `group`.

        Args:
            pieces: (weight index, hp, out) per local piece: hp (n,) float32 contiguous, out
                (n,) its FP8 destination (a view of the weight's data). A rank may hold no
                piece of a weight; every rank calls with the same W.
            group: the torch.distributed group the pieces are spread over.
        """
        for i, hp, _ in pieces:
            ops.amax_(hp, self.amax[i : i + 1])
        max_all_reduce_(self.amax, group)
        ops.scale_update_(self.amax.view(1, -1), self.scale, self.scaled_max, True)  # amax -> 0
        torch.reciprocal(self.scale, out=self.scale_inv)
        for i, hp, out in pieces:
            ops.cast_to_fp8(hp, self.scale[i : i + 1], self.sink[0:1], out.dtype, out=out,
                            scale_inv=self.sink[1:2])  # fmt: skip
