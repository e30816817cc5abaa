"""graphfp8-train --fsdp: the GPT under torch FSDP2 (docs/sharding.md, "FSDP2"), eager only.

The run calls the embedding, the blocks and the loss (norm, head) one by one, never the model's
forward, so each of them is a root of its own: fully_shard on every TransformerLayer and then on
the blocks, the embedding, the norm and the head, with FSDP2's defaults (reshard_after_forward
True). FP8 primary weights (--fp8-weights) stay FP8 shards, all-gathered as FP8, trained through
FSDPMasterWeights.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

__all__ = ["REFUSED", "check_fsdp_spec", "shard_gpt"]

# What --fsdp does not run, and why (training/cli.py refuses each before anything starts).
REFUSED = {
    "graphs": "graph capture of an FSDP2 model is not supported by graphfp8-train's graph modes "
    "(per-layer graphs and the step graph: its hooks run in Python around every module; in code, "
    "make_graphed_microbatch captures its forward and backward): use --graphs none, or --shard "
    "(sharded masters) for the graphed modes",
    "shard": "--shard and --fsdp are two ways to shard: pick one (docs/sharding.md, 'Which to "
    "pick')",
    "save": "--save/--resume write graphfp8-train's checkpoints, not FSDP2's: use "
    "graphfp8.training.dcp_checkpoint",
    "check_replicas": "--check-replicas compares replicated weights; FSDP2's are sharded",
    "compile": "--compile with --fsdp is not supported",
}


def check_fsdp_spec(spec) -> None:
    """A RunSpec with fsdp runs eagerly, without shard and compile."""
    if spec.fsdp and (spec.graphs != "none" or spec.shard or spec.compile):
        raise ValueError("fsdp runs eagerly (graphs 'none'), without shard and compile")


def shard_gpt(model: torch.nn.Module, group, device) -> None:
    """fully_shard the GPT's layers and its parts over `group` (a 1-D mesh of its ranks)."""
    if group is None:
        raise ValueError("fsdp needs a process group (--ddp under torchrun)")
    mesh = DeviceMesh.from_group(group, torch.device(device).type)
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    for part in (model.blocks, model.embed, model.norm, model.head):
        fully_shard(part, mesh=mesh)
