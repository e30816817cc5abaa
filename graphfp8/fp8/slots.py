"""Named FP8 slot roles: which tensor of a GEMM each arena slot quantizes.

A module with G FP8 GEMMs owns len(FwdRole) * G consecutive forward slots and len(BwdRole) * G
backward slots (TransformerEngine's FP8FwdTensors / FP8BwdTensors layout, without its grad-input
slot, which no cast uses). Slot arithmetic lives here and nowhere else:

    forward  slot(role, g) = 3 g + role     INPUT, WEIGHT, OUTPUT (OUTPUT only with fp8_output)
    backward slot(role, g) = g              GRAD_OUTPUT
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

__all__ = ["BwdRole", "FwdRole", "Quantizer", "slot_index", "slots_per_gemm"]


class FwdRole(enum.IntEnum):
    """Forward-arena slots of one GEMM y = x @ w.T."""

    INPUT = 0
    WEIGHT = 1
    OUTPUT = 2


class BwdRole(enum.IntEnum):
    """Backward-arena slots of one GEMM: dy, the gradient of its output."""

    GRAD_OUTPUT = 0


def slots_per_gemm(role_type: type[enum.IntEnum]) -> int:
    """How many slots of that direction one GEMM owns."""
    return len(role_type)


def slot_index(role: FwdRole | BwdRole, gemm: int) -> int:
    """The slot of `role` for GEMM number `gemm` of a module, counted from its first slot."""
    return slots_per_gemm(type(role)) * gemm + int(role)


class Quantizer(NamedTuple):
    """What one cast into an FP8 slot needs, in the order the ops take it.

    scale: (1,) float32 view of the slot's scale; amax: (1,) float32 view of its H[0], where the
    cast folds max|x|; fp8_dtype: the direction's FP8 format.
    """

    scale: torch.Tensor
    amax: torch.Tensor
    fp8_dtype: torch.dtype
