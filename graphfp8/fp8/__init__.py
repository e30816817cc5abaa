"""The FP8 state layer: recipes, slot roles, arenas, Float8Tensor, the FP8 context and
fp8_autocast.

Imports flow one way: recipe -> slots -> (ops) -> tensor -> primary -> master (the unsharded fp32
masters; the sharded and FSDP2 kinds live in graphfp8.distributed, above), and tensor ->
arena_check -> scaling -> current; tensor -> weight_cache -> context -> (master, scale_schedule,
autocast), scaling -> scale_schedule.
"""

from graphfp8.fp8.autocast import autocast, fp8_autocast, reset_state
from graphfp8.fp8.master import MasterWeights
from graphfp8.fp8.primary import fp8_model_init
from graphfp8.fp8.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    fp8_max,
)
from graphfp8.fp8.slots import AttnBwdRole, AttnFwdRole, BwdRole, FwdRole
from graphfp8.fp8.tensor import Float8Tensor

__all__ = [
    "autocast",
    "AttnBwdRole",
    "AttnFwdRole",
    "BwdRole",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8Tensor",
    "Format",
    "MasterWeights",
    "FwdRole",
    "fp8_autocast",
    "fp8_max",
    "fp8_model_init",
    "reset_state",
]
