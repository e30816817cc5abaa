"""Current scaling: each cast's scale computed on the device from the tensor it is about to cast.

Per cast, under graphfp8.Float8CurrentScaling (docs/fp8.md, "Current scaling"):

    amax pass   the cast itself (or its fused variant: norm, GELU, dGELU) once with its outputs
                dropped, folding max|x| into the slot's H[0] (NaNs ignored, as every cast does)
    update      the delayed-scaling kernel on that one slot, whose history is one long:
                scale = fp8_max / H[0] when finite and > 0, else unchanged; H[0] back to 0
    cast        the real cast with that scale; its amax goes to the arena's sink

Three launches, no host work: the same sequence runs eagerly and inside a graph. A weight cast
passes its noop flag to the amax pass too, so a cached weight leaves its slot untouched. No new
kernel is needed; a dedicated amax kernel would save the amax pass's FP8 write (1 byte/element).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphfp8 import ops
from graphfp8.fp8.recipe import is_current_scaling
from graphfp8.fp8.scaling import SlotBlock
from graphfp8.fp8.slots import Quantizer

__all__ = ["AmaxPass", "amax_of", "slot_quantizer"]

# Runs a cast into the given quantizer and drops its outputs: only the amax it folds matters.
AmaxPass = Callable[[Quantizer], object]


def amax_of(x: torch.Tensor, noop: torch.Tensor | None = None) -> AmaxPass:
    """The amax pass of a plain cast of x: (...) float32/bfloat16/float16, contiguous. noop: the
    (1,) float32 flag of a weight cast, or None."""
    return lambda q: ops.cast_to_fp8(x, *q, noop=noop)


def slot_quantizer(block: SlotBlock, i: int, amax_pass: AmaxPass | None) -> Quantizer:
    """(scale, amax, fp8_dtype) for a cast into slot i of `block`.

    Delayed scaling: the slot's scale and H[0] views. Current scaling: runs `amax_pass` into the
    slot, derives the slot's scale from it on the device, and returns the slot's scale with the
    arena's amax sink (the cast must not fold its amax into H[0] again).

    Args:
        block: the module's slot block of the cast's direction.
        i: the slot's index in the block.
        amax_pass: the cast's amax pass (`amax_of(x)` for a plain cast); required under current
            scaling, ignored otherwise.
    """
    arena = block.arena
    quantizer = Quantizer(block.scale(i), block.amax(i), arena.fp8_dtype)
    if not is_current_scaling(arena.recipe):
        return quantizer
    if amax_pass is None:
        raise RuntimeError(
            "graphfp8: this FP8 cast does not support Float8CurrentScaling (no amax pass)"
        )
    amax_pass(quantizer)
    s = block.start + i
    ops.scale_update_(
        arena.amax_history[:, s : s + 1], arena.scale[s : s + 1], arena.scaled_max[s : s + 1], True
    )
    return Quantizer(quantizer.scale, arena.amax_sink, arena.fp8_dtype)
