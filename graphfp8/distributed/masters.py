"""graphfp8.MasterWeights: builds the kind of fp32 masters a model's training needs, by name.

    g8.MasterWeights(model)                       # MasterWeights (graphfp8.fp8.master): unsharded
    g8.MasterWeights(model, shard_group=group)    # ShardedMasterWeights (sharded_masters.py)
    g8.MasterWeights(fsdp_model)                  # FSDPMasterWeights (fsdp_masters.py): the model's
                                                  # FP8 weights are FSDP2 shards

Each class can be built by its own name as well; this function only routes (docs/sharding.md).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from graphfp8.distributed.fsdp_masters import FSDPMasterWeights
from graphfp8.distributed.sharded_masters import ShardedMasterWeights
from graphfp8.fp8.master import MasterWeights as UnshardedMasterWeights
from graphfp8.fp8.tensor import is_fsdp_fp8

__all__ = ["MasterWeights"]

_UNSET = object()  # shard_group left out: unsharded, unlike an explicit None


def MasterWeights(model: nn.Module, shard_group=_UNSET, **sharded_options):  # noqa: N802 - public
    """fp32 masters of `model` for a torch optimizer (graphfp8.fp8.master's module docstring).

    Args:
        model: a module with FP8 primary weights (created inside graphfp8.fp8_model_init); with
            shard_group, any replicated model.
        shard_group: a torch.distributed group: shard the masters of every trainable parameter,
            their gradients and the optimizer state over its ranks (docs/sharding.md). None
            means the default group, as DDP's process_group=None, once torch.distributed is
            initialised with more than one rank (unsharded otherwise); left out, unsharded.
        **sharded_options: bucket_mb, check_every_step, independent_groups
            (ShardedMasterWeights'), with shard_group.

    Returns:
        A ShardedMasterWeights with shard_group; an FSDPMasterWeights for a model whose FP8
        weights torch FSDP2 (fully_shard) shards; otherwise an unsharded MasterWeights.
    """
    if shard_group is None and dist.is_initialized() and dist.get_world_size() > 1:
        shard_group = dist.group.WORLD
    if shard_group is not _UNSET and shard_group is not None:
        return ShardedMasterWeights(model, shard_group, **sharded_options)
    if sharded_options:
        raise TypeError(f"MasterWeights: {sorted(sharded_options)} need shard_group")
    if any(is_fsdp_fp8(p) for p in model.parameters()):
        return FSDPMasterWeights(model)
    return UnshardedMasterWeights(model)
