"""graphfp8-train --fsdp: the GPT under torch FSDP2 (docs/sharding.md, "FSDP2"), eager, in a graph
pair per layer (--graphs layers: graphs/fsdp_layers.py) or in one step graph (--graphs step:
graphs/step_fsdp.py).

The eager run calls the embedding, the blocks and the loss (norm, head) one by one, never the
model's forward, so each of them is a root of its own: fully_shard on every TransformerLayer and
then on the blocks, the embedding, the norm and the head, with FSDP2's defaults
(reshard_after_forward True). With --graphs layers each layer is captured through a LayerCall
(the call Blocks makes, with tensor arguments only) and the blocks' root runs eagerly around
them. The step graph calls the model's forward, so the model is under
fully_shard too (a root without parameters of its own, as make_graphed_step requires). FP8
primary weights (--fp8-weights) stay FP8 shards, all-gathered as FP8, trained through
FSDPMasterWeights. --hsdp R: the same on HSDP's 2-D (R, N / R) mesh (docs/sharding.md, "HSDP").
--fsdp-prefetch: FSDP2's explicit prefetch, layer i to i + 1 forward and to i - 1 backward
(inside the layer graphs too: graphs/fsdp_prefetch.py).
--fsdp-sync last: FSDP2's gradient sync and reshard after backward off on every microbatch but
the last, eagerly (set_fsdp_sync) around the layer graphs too (make_graphed_callables(...,
fsdp_sync="last"): each layer's sync graph reduce-scatters after the last microbatch's backward)
and in the step graph (make_graphed_step(fsdp_sync="last")).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from graphfp8.graphs import init_fsdp2, make_graphed_callables

__all__ = ["REFUSED", "LayerCall", "check_fsdp_spec", "graph_layers", "shard_gpt"]

# What --fsdp does not run, and why (training/cli.py refuses each before anything starts).
REFUSED = {
    "graphs": "--graphs compile with --fsdp is not supported: use --graphs layers (a graph "
    "pair per layer), step (the whole step, FSDP2's collectives included, in one graph) or none",
    "shard": "--shard and --fsdp are two ways to shard: pick one (docs/sharding.md, 'Which to "
    "pick')",
    "save": "--save/--resume write graphfp8-train's checkpoints, not FSDP2's: use "
    "graphfp8.training.dcp_checkpoint",
    "check_replicas": "--check-replicas compares replicated weights; FSDP2's are sharded",
    "compile": "--compile with --fsdp is not supported",
}


def check_fsdp_spec(spec) -> None:
    """A RunSpec with fsdp runs eagerly, in layer graphs or in the step graph, without shard and
    compile; hsdp, fsdp_sync 'last' and fsdp_prefetch need fsdp."""
    if spec.fsdp and (spec.graphs == "compile" or spec.shard or spec.compile):
        raise ValueError("fsdp runs eagerly, in layer graphs or in the step graph (graphs "
                         "'none', 'layers' or 'step'), without shard and compile")  # fmt: skip
    if spec.hsdp < 1 or (spec.hsdp > 1 and not spec.fsdp):
        raise ValueError(f"hsdp {spec.hsdp}: replicas (>= 1) of FSDP2's shards, with fsdp")
    if spec.fsdp_sync not in ("every", "last") or (spec.fsdp_sync != "every" and not spec.fsdp):
        raise ValueError(f"fsdp_sync {spec.fsdp_sync!r}: 'every' or 'last' (with fsdp)")
    if spec.fsdp_prefetch and not spec.fsdp:
        raise ValueError("fsdp_prefetch: FSDP2's explicit prefetch, with fsdp")


def shard_gpt(model: torch.nn.Module, group, device, replicas: int = 1, root: bool = False,
              prefetch: bool = False) -> None:  # fmt: skip
    """fully_shard the GPT's layers and its parts over `group`: a 1-D mesh of its ranks, or with
    replicas > 1 HSDP's 2-D (replicas, world / replicas) mesh of the world's ranks (each
    replica's ranks shard the weights; FSDP2 all-reduces the gradients across the replicas);
    `root`: the model itself too (the step graph runs its forward); `prefetch`: FSDP2's explicit
    prefetch of layer i + 1 in layer i's forward and of layer i - 1 in its backward."""
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
    layers = list(model.blocks.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    for i, layer in enumerate(layers if prefetch else ()):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])
        layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0) : i])
    for part in (model.blocks, model.embed, model.norm, model.head):
        fully_shard(part, mesh=mesh)
    if root:
        fully_shard(model, mesh=mesh)


class LayerCall(nn.Module):
    """Layer i as Blocks calls it (training/model.py), with tensor arguments only, as
    make_graphed_callables takes them: (x (B, S, H)[, residual (B, S, H)][, segment_ids
    (B, S)]) -> out, or (out, residual) for a layer that hands its residual add on."""

    def __init__(self, layer: nn.Module, last: bool):
        super().__init__()
        self.layer, self.last = layer, last

    @property
    def training(self) -> bool:
        """The layer's mode (model.eval() reaches the layer, not this call, which is no submodule
        of the model): a graphed call in eval mode runs the layer eagerly, as torch's rule says."""
        layer = self.__dict__.get("_modules", {}).get("layer")
        return True if layer is None else layer.training

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # follows the layer's

    def forward(self, x, residual=None, segment_ids=None, is_first_microbatch=None):
        kw = {} if segment_ids is None else {"segment_ids": segment_ids}
        return self.layer(x, is_first_microbatch=is_first_microbatch, residual=residual,
                          defer_residual=not self.last, **kw)  # fmt: skip


def graph_layers(model: nn.Module, sample: torch.Tensor, segments: dict, fp8: bool, recipe,
                 group, fsdp_sync: str = "every") -> None:  # fmt: skip
    """make_graphed_callables of the FSDP2 GPT's layers, one graph pair each (a LayerCall), set
    as the calls Blocks makes (Blocks.graphed); the blocks' root (fully_shard(model.blocks))
    stays eager around them. sample: (B, S, H) bf16 requiring grad; segments: {"segment_ids":
    (B, S) int64} of packed runs or {}; the bf16 layers captured without FP8 (Blocks runs them
    inside fp8_autocast(enabled=False)); fsdp_sync: make_graphed_callables'."""
    blocks = model.blocks
    init_fsdp2(blocks)
    n = len(blocks.layers)
    calls = tuple(LayerCall(layer, i == n - 1) for i, layer in enumerate(blocks.layers))
    args = tuple((sample,) if i == 0 else (sample, sample.detach().clone().requires_grad_())
                 for i in range(n))  # fmt: skip
    blocks.graphed = make_graphed_callables(
        calls, args, sample_kwargs=tuple(dict(segments) for _ in range(n)),
        fp8_enabled=tuple(fp8 and i not in blocks.bf16_layers for i in range(n)),
        fp8_recipe=recipe, fp8_weight_caching=True, fp8_group=group, fsdp_sync=fsdp_sync,
    )  # fmt: skip
