"""The FP8 state layer: recipes, slot roles, arenas, Float8Tensor and fp8_autocast.

Imports flow one way: recipe -> slots -> (ops) -> tensor -> arena_check -> scaling -> autocast.
"""

from graphfp8.fp8.autocast import fp8_autocast, reset_state
from graphfp8.fp8.recipe import DelayedScaling, Format, fp8_max
from graphfp8.fp8.slots import AttnBwdRole, AttnFwdRole, BwdRole, FwdRole
from graphfp8.fp8.tensor import Float8Tensor

__all__ = [
    "AttnBwdRole",
    "AttnFwdRole",
    "BwdRole",
    "DelayedScaling",
    "Float8Tensor",
    "Format",
    "FwdRole",
    "fp8_autocast",
    "fp8_max",
    "reset_state",
]
