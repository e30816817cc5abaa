"""graphfp8-train --fsdp: the GPT under torch FSDP2 (docs/sharding.md, "FSDP2"), eager or in one
step graph (--graphs step: graphs/step_fsdp.py).

The eager run calls the embedding, the blocks and the loss (norm, head) one by one, never the
model's forward, so each of them is a root of its own: fully_shard on every TransformerLayer and
then on the blocks, the embedding, the norm and the head, with FSDP2's defaults
(reshard_after_forward True). The step graph calls the model's forward, so the model is under
fully_shard too (a root without parameters of its own, as make_graphed_step requires). FP8
primary weights (--fp8-weights) stay FP8 shards, all-gathered as FP8, trained through
FSDPMasterWeights. --hsdp R: the same on HSDP's 2-D (R, N / R) mesh (docs/sharding.md, "HSDP").
--fsdp-sync last: FSDP2's gradient sync and reshard after backward off on every microbatch but
the last, eagerly (set_fsdp_sync) and in the step graph (make_graphed_step(fsdp_sync="last")).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

__all__ = ["REFUSED", "check_fsdp_spec", "shard_gpt"]

# What --fsdp does not run, and why (training/cli.py refuses each before anything starts).
REFUSED = {
    "graphs": "per-layer graph capture of an FSDP2 model is not supported (--graphs layers: "
    "FSDP2's hooks all-gather the weights around the very call a layer graph replays): use "
    "--graphs step (the whole step, FSDP2's collectives included, in one graph) or none",
    "shard": "--shard and --fsdp are two ways to shard: pick one (docs/sharding.md, 'Which to "
    "pick')",
    "save": "--save/--resume write graphfp8-train's checkpoints, not FSDP2's: use "
    "graphfp8.training.dcp_checkpoint",
    "check_replicas": "--check-replicas compares replicated weights; FSDP2's are sharded",
    "compile": "--compile with --fsdp is not supported",
}


def check_fsdp_spec(spec) -> None:
    """A RunSpec with fsdp runs eagerly or in the step graph, without shard and compile; hsdp
    and fsdp_sync 'last' need fsdp."""
    if spec.fsdp and (spec.graphs not in ("none", "step") or spec.shard or spec.compile):
        raise ValueError("fsdp runs eagerly or in the step graph (graphs 'none' or 'step'), "
                         "without shard and compile")  # fmt: skip
    if spec.hsdp < 1 or (spec.hsdp > 1 and not spec.fsdp):
        raise ValueError(f"hsdp {spec.hsdp}: replicas (>= 1) of FSDP2's shards, with fsdp")
    if spec.fsdp_sync not in ("every", "last") or (spec.fsdp_sync != "every" and not spec.fsdp):
        raise ValueError(f"fsdp_sync {spec.fsdp_sync!r}: 'every' or 'last' (with fsdp)")


def shard_gpt(model: torch.nn.Module, group, device, replicas: int = 1,
              root: bool = False) -> None:  # fmt: skip
    """fully_shard the GPT's layers and its parts over `group`: a 1-D mesh of its ranks, or with
    replicas > 1 HSDP's 2-D (replicas, world / replicas) mesh of the world's ranks (each
    replica's ranks shard the weights; FSDP2 all-reduces the gradients across the replicas);
    `root`: the model itself too (the step graph runs its forward)."""
    if group is None:
        raise ValueError("fsdp needs a process group (--ddp under torchrun)")
    kind = torch.device(device).type
    if replicas == 1:
        mesh = DeviceMesh.from_group(group, kind)
    else:
        world = torch.distributed.get_world_size(group)
        if group is not torch.distributed.group.WORLD or world % replicas:
            raise ValueError(f"hsdp: {replicas} replicas of the whole world (--ddp), a divisor "
                             f"of its {world} ranks")  # fmt: skip
        mesh = init_device_mesh(kind, (replicas, world // replicas),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
    for layer in model.blocks.layers:
        fully_shard(layer, mesh=mesh)
    for part in (model.blocks, model.embed, model.norm, model.head):
        fully_shard(part, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)
