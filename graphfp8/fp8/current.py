"""Current scaling: each cast's scale computed on the device from the tensor it is about to cast.

Per cast, under graphfp8.Float8CurrentScaling (docs/fp8.md, "Current scaling"), one of two
launch sequences, equal bit for bit in every output, scale and history (the arena's amax sink,
which nothing reads, is only written by the three-launch one):

  two launches (the fused path)
    amax pass   a read-only kernel (graphfp8.ops.amax_ and its GELU, dGELU, norm forms) folds
                max|f(x)| into the slot's H[0] (NaNs ignored), writing nothing else
    cast        the cast in its `scaled_max` form: it derives the slot's scale from H[0] itself
                (scale = fp8_max / H[0] when finite and > 0, else unchanged), writes it back,
                resets H[0] to 0 and casts with it
  three launches (the first implementation)
    amax pass   the cast itself (or its fused variant) with its outputs dropped
    update      the delayed-scaling kernel on that one slot, whose history is one long
    cast        the real cast with that scale; its amax goes to the arena's sink

No host work either way: the same sequence runs eagerly and inside a graph. A weight cast passes
its noop flag to the amax pass too, so a cached weight leaves its slot untouched. The fused path
is the default (its CUDA kernels ran on the H200 on 2026-12-01, equal to the three-launch path in
the CUDA tests); GRAPHFP8_CURRENT_FUSED=0 in the environment (read at import) takes the three
launches on CUDA. The module flags FUSED_ON_CUDA and FUSED_ON_CPU choose at run time, which the
tests use to compare the two paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from graphfp8 import ops
from graphfp8.fp8.recipe import is_current_scaling
from graphfp8.fp8.scaling import ReplaySlots, SlotBlock
from graphfp8.fp8.slots import Quantizer
from graphfp8.ops.switches import env_switch

__all__ = [
    "AmaxPass",
    "CurrentQuantizer",
    "FUSED_ON_CPU",
    "FUSED_ON_CUDA",
    "amax_of",
    "dgelu_amax_of",
    "fused",
    "gelu_amax_of",
    "own_scale",
    "slot_quantizer",
]

# Runs a cast's amax pass into the given quantizer: only the amax it folds matters.
AmaxPass = Callable[[Quantizer], object]

FUSED_ON_CUDA = env_switch("CURRENT_FUSED")
FUSED_ON_CPU = True


class CurrentQuantizer(NamedTuple):
    """A Quantizer for the fused path: the casts take scaled_max as their fourth argument
    (graphfp8.ops.cast_to_fp8) and then compute the slot's scale from its H[0] themselves.

    scale, amax: (1,) float32 views of the slot's scale and H[0]; fp8_dtype: the direction's
    format; scaled_max: (1,) float32 view of the slot's fp8_max * 2**-margin.
    """

    scale: torch.Tensor
    amax: torch.Tensor
    fp8_dtype: torch.dtype
    scaled_max: torch.Tensor


def fused(device: torch.device) -> bool:
    """Whether current-scaling casts on `device` take the two-launch fused path."""
    return FUSED_ON_CUDA if device.type == "cuda" else FUSED_ON_CPU


def amax_of(x: torch.Tensor, noop: torch.Tensor | None = None) -> AmaxPass:
    """The amax pass of a plain cast of x: (...) float32/bfloat16/float16, contiguous. noop: the
    (1,) float32 flag of a weight cast, or None."""
    if fused(x.device):
        return lambda q: ops.amax_(x, q.amax, noop)
    return lambda q: ops.cast_to_fp8(x, q.scale, q.amax, q.fp8_dtype, noop=noop)


def gelu_amax_of(h: torch.Tensor) -> AmaxPass:
    """The amax pass of gelu_cast_transpose(h): h (M, F) float, contiguous."""
    if fused(h.device):
        return lambda q: ops.gelu_amax_(h, q.amax)
    return lambda q: ops.gelu_cast_transpose(h, q.scale, q.amax, q.fp8_dtype)


def dgelu_amax_of(dy: torch.Tensor, h: torch.Tensor) -> AmaxPass:
    """The amax pass of dgelu_cast_transpose_dbias(dy, h): dy, h (M, F) of one float dtype."""
    if fused(dy.device):
        return lambda q: ops.dgelu_amax_(dy, h, q.amax)
    return lambda q: ops.dgelu_cast_transpose_dbias(dy, h, q.scale, q.amax, q.fp8_dtype)


def slot_quantizer(
    block: SlotBlock, i: int, amax_pass: AmaxPass | None, three_launch: bool = False
) -> Quantizer | CurrentQuantizer:
    """(scale, amax, fp8_dtype[, scaled_max]) for a cast into slot i of `block`.

    Delayed scaling, and a recomputed forward's ReplaySlots: the slot's scale and amax views.
    Current scaling: runs `amax_pass` into the
    slot; then, on the fused path, returns a CurrentQuantizer (the cast computes the scale), and
    otherwise derives the slot's scale on the device and returns the slot's scale with the
    arena's amax sink (the cast must not fold its amax into H[0] again).

    Args:
        block: the module's slot block of the cast's direction.
        i: the slot's index in the block.
        amax_pass: the cast's amax pass (`amax_of(x)` for a plain cast); required under current
            scaling, ignored otherwise.
        three_launch: take the three-launch sequence even where the fused one is on (for casts
            whose kernels take no scaled_max: the GLU casts).
    """
    arena = block.arena
    quantizer = Quantizer(block.scale(i), block.amax(i), arena.fp8_dtype)
    if not is_current_scaling(arena.recipe) or isinstance(block, ReplaySlots):
        return quantizer  # a recompute casts with the forward's scale, computed then
    if amax_pass is None:
        raise RuntimeError(
            "graphfp8: this FP8 cast does not support Float8CurrentScaling (no amax pass)"
        )
    amax_pass(quantizer)
    s = block.start + i
    if fused(arena.device) and not three_launch:
        return CurrentQuantizer(*quantizer, arena.scaled_max[s : s + 1])
    ops.scale_update_(
        arena.amax_history[:, s : s + 1], arena.scale[s : s + 1], arena.scaled_max[s : s + 1], True
    )
    return Quantizer(quantizer.scale, arena.amax_sink, arena.fp8_dtype)


def own_scale(block: SlotBlock, i: int, x: torch.Tensor) -> torch.Tensor:
    """A (1,) float32 scale for casting x into slot i of `block` computed from x alone, as the
    slot's delayed update would from a history holding only max |x| (the slot's scale where that
    is 0 or not finite); the arena is read, never written. Evaluation casts a weight with it
    (graphfp8/modules/_context.py): a weight changed since training last cast it (a LoRA merge,
    an EMA swap) gets a scale of its own. x: (...) float32/bfloat16/float16, contiguous."""
    arena, s = block.arena, block.start + i
    history = torch.zeros(1, 1, dtype=torch.float32, device=x.device)
    ops.amax_(x, history[0])
    scale = arena.scale[s : s + 1].clone()
    ops.scale_update_(history, scale, arena.scaled_max[s : s + 1], True)
    return scale
