"""Distributed training: data parallelism, the collectives, the one reduce -> clip -> step ->
write-back protocol, sharded masters (ZeRO-style) and masters of an FSDP2 model, group
quantization, sharded checkpoint files and replica checks (docs/sharding.md, "Where the code
lives")."""

from graphfp8.distributed.data_parallel import (
    DistInfo,
    SettingsMismatchError,
    allreduce_gradients,
    check_gradient_layout,
    check_same_settings,
    cleanup,
    gather_objects,
    init_distributed,
    is_distributed,
    mark_sharded,
)
from graphfp8.distributed.fsdp_masters import FSDPMasterWeights, fsdp_fp8_weights
from graphfp8.distributed.gradient_update import GradientUpdate, ReplicatedUpdate, gradient_update
from graphfp8.distributed.masters import MasterWeights
from graphfp8.distributed.optimizer_meta import register_fused_optimizer_meta
from graphfp8.distributed.sharded_masters import ShardedMasterWeights

# DTensor steps of fused Adam/AdamW with a tensor learning rate without an unsharded transient
register_fused_optimizer_meta()

__all__ = [
    "DistInfo",
    "FSDPMasterWeights",
    "GradientUpdate",
    "MasterWeights",
    "ReplicatedUpdate",
    "SettingsMismatchError",
    "ShardedMasterWeights",
    "allreduce_gradients",
    "check_gradient_layout",
    "check_same_settings",
    "cleanup",
    "fsdp_fp8_weights",
    "gather_objects",
    "gradient_update",
    "init_distributed",
    "is_distributed",
    "mark_sharded",
]
