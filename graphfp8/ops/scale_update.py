"""Typed wrapper of the fused multi-slot delayed-scaling update."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["scale_update_"]


@wraps_op("scale_update")
def scale_update_(
    amax_history: torch.Tensor, scale: torch.Tensor, scaled_max: torch.Tensor, most_recent: bool
) -> None:
    """Rolls every slot's amax history and recomputes its scale, in place, in one launch.

    Per slot (docs/fp8.md): a = H[0]; if a != 0, H = [0, H[2], ..., H[L-1], a] and m is the max of
    H[1..L-1] and a; amax = a if most_recent else m; scale = scaled_max / amax when amax is finite
    and > 0 (else unchanged); an infinite scale becomes FLT_MAX.

    Args:
        amax_history: (history_len, num_slots) float32, contiguous; row 0 holds the new amaxes.
        scale: (num_slots,) float32, updated in place.
        scaled_max: (num_slots,) float32, fp8_max * 2**-margin of each slot.
        most_recent: amax_compute_algo == "most_recent".
    """
    ops.scale_update(amax_history, scale, scaled_max, bool(most_recent))
