"""The one observation point of every FP8 cast, for the numerics report (graphfp8.numerics).

Each cast site of the layers calls `observe_cast` right after its cast with the slot it cast
into and a `StatsSource`: the tensor it quantized, or - for fused kernels that never write it
(norm, GELU, dGELU) - the inputs from which the statistics kernel recomputes it in the fused
kernel's arithmetic. With no observer installed (the default) that is one test per cast; an
observer installed before a capture records its statistics kernels into the graphs.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from graphfp8.fp8.scaling import ReplaySlots, SlotBlock

__all__ = ["Observer", "StatsSource", "install", "observe_block", "observe_cast", "observer"]


class StatsSource(NamedTuple):
    """What a cast quantized, as graphfp8.ops.cast_stats takes it.

    mode: "identity" (x itself), "gelu" (gelu(x)), "dgelu" (dy = x, GELU input act_in),
    "layernorm" / "rmsnorm" (z = x (rows, hidden) with the kernel's mu / rsigma and the norm's
    gamma / beta), or "recorded": a cast inside a kernel whose high-precision tensor never
    exists and is not recomputed (RoPE fused into the casts of q and k, cuDNN's FP8 attention
    output and gradients): only the slot's scale and recorded amax, x being the FP8 result.
    skip: a weight cast's (1,) noop flag (1: nothing was cast).
    """

    mode: str
    x: torch.Tensor
    act_in: torch.Tensor | None = None
    mu: torch.Tensor | None = None
    rsigma: torch.Tensor | None = None
    gamma: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    zero_centered_gamma: bool = False
    skip: torch.Tensor | None = None


class Observer(Protocol):
    def cast(self, block: SlotBlock, i: int, role: str, source: StatsSource) -> None:
        """Called after a cast into slot i of `block`, under `role` ("input", ...)."""


_OBSERVER: Observer | None = None


def observer() -> Observer | None:
    """The installed observer, or None."""
    return _OBSERVER


def install(obs: Observer | None) -> Observer | None:
    """Installs `obs` (None: none) and returns the previous observer."""
    global _OBSERVER
    previous, _OBSERVER = _OBSERVER, obs
    return previous


def observe_cast(block: SlotBlock, i: int, role: str, source) -> None:
    """Reports a cast into slot i of `block` to the observer, if one is installed.

    Args:
        block: the module's slot block of the cast's direction.
        i: the slot's index in the block.
        role: the slot's role name ("input", "weight", "output", "grad_output").
        source: a StatsSource, or a function returning one (called only when an observer is
            installed, so the cast sites build nothing otherwise).
    """
    obs = _OBSERVER
    if obs is not None and not isinstance(block, ReplaySlots):  # a recompute: seen once already
        obs.cast(block, i, role, source() if callable(source) else source)


def observe_block(weight: torch.Tensor, role: str, source) -> None:
    """Reports a blockwise quantization (a GEMM operand under Float8BlockScaling, which has no
    slots) to the observer (graphfp8.numerics_blockwise.BlockStats); an observer that does not
    take them (FP8Stats) raises rather than report nothing.

    Args:
        weight: the GEMM's weight parameter: which layer and GEMM the operand belongs to.
        role: "input", "weight" or "grad_output".
        source: a function returning (x (R, C) high precision, x_fp8, scale_inv, rows), the
            arguments of graphfp8.ops.blockwise_stats.block_stats; the observer calls it only
            for a quantization it records (BlockStats: none eagerly while disabled).
    """
    if _OBSERVER is None:
        return
    take = getattr(_OBSERVER, "block_cast", None)
    if take is None:  # it would report nothing of these GEMMs: say so
        raise RuntimeError(
            f"{type(_OBSERVER).__name__} observes per-tensor FP8 casts, and a Float8BlockScaling "
            "GEMM ran: create graphfp8.numerics_blockwise.BlockStats(model) for its per-block "
            "statistics (after the FP8Stats, for a model mixing recipes)"
        )
    take(weight, role, source)  # it calls source() only for what it records
