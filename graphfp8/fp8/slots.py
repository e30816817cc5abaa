"""Named FP8 slot roles: which tensor of a GEMM, or of an FP8 attention, each arena slot quantizes.

A module with G FP8 GEMMs owns len(FwdRole) * G consecutive forward slots and len(BwdRole) * G
backward slots (TransformerEngine's FP8FwdTensors / FP8BwdTensors layout, without its grad-input
slot, which no cast uses); an FP8 attention owns len(AttnFwdRole) forward and len(AttnBwdRole)
backward slots. Slot arithmetic lives here and nowhere else (a unit is a GEMM or an attention):

    forward  slot(role, g) = 3 g + role     INPUT, WEIGHT, OUTPUT (OUTPUT only with fp8_output)
    backward slot(role, g) = g              GRAD_OUTPUT
    forward  slot(role, a) = 5 a + role     Q, K, V, S, O
    backward slot(role, a) = 5 a + role     DO, DP, DQ, DK, DV
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

__all__ = [
    "AttnBwdRole",
    "AttnFwdRole",
    "BwdRole",
    "FwdRole",
    "Quantizer",
    "slot_index",
    "slot_range",
    "slots_per_gemm",
]


class FwdRole(enum.IntEnum):
    """Forward-arena slots of one GEMM y = x @ w.T."""

    INPUT = 0
    WEIGHT = 1
    OUTPUT = 2


class BwdRole(enum.IntEnum):
    """Backward-arena slots of one GEMM: dy, the gradient of its output."""

    GRAD_OUTPUT = 0


class AttnFwdRole(enum.IntEnum):
    """Forward-arena slots of one FP8 attention O = softmax(Q K^T * attn_scale) V: its inputs,
    the softmax output S (quantized inside the attention kernel) and its output."""

    Q = 0
    K = 1
    V = 2
    S = 3
    O = 4  # noqa: E741 - the attention output's conventional name


class AttnBwdRole(enum.IntEnum):
    """Backward-arena slots of one FP8 attention: dO, dP (the gradient of the softmax input,
    quantized inside the attention kernel; cuDNN's name), and the gradients dQ, dK, dV."""

    DO = 0
    DP = 1
    DQ = 2
    DK = 3
    DV = 4


def slots_per_gemm(role_type: type[enum.IntEnum]) -> int:
    """How many slots of that direction one unit (a GEMM, or an attention) owns."""
    return len(role_type)


def slot_index(role: enum.IntEnum, unit: int) -> int:
    """The slot of `role` for unit number `unit` (GEMM or attention) of a module, counted from
    the module's first slot of that direction."""
    return slots_per_gemm(type(role)) * unit + int(role)


def slot_range(first: enum.IntEnum, last: enum.IntEnum, unit: int) -> slice:
    """The consecutive slots from role `first` to role `last` (inclusive) of one unit: one view
    serves kernels that read or write several scales at once."""
    if type(first) is not type(last) or int(last) < int(first):
        raise ValueError(f"slot_range: {first!r}..{last!r} is not a range of one role type")
    return slice(slot_index(first, unit), slot_index(last, unit) + 1)


class Quantizer(NamedTuple):
    """What one cast into an FP8 slot needs, in the order the ops take it.

    scale: (1,) float32 view of the slot's scale; amax: (1,) float32 view of its H[0], where the
    cast folds max|x|; fp8_dtype: the direction's FP8 format.
    """

    scale: torch.Tensor
    amax: torch.Tensor
    fp8_dtype: torch.dtype
