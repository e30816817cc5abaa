"""A model that carries its FP8 recipe, the one door of the carried recipe: a training loop that
knows nothing of FP8 (Hugging Face Trainer, accelerate, Lightning) trains it in FP8 unchanged.

    model = g8.from_hf(hf, recipe=g8.DelayedScaling())      # or g8.convert(model, recipe=...)
    loss = model(input_ids, labels=labels).loss                # FP8, no fp8_autocast around it

The entrance: every carried call enters `FP8Carry.region(model)` - the forward hooks of
`g8.convert(recipe=)` (carry() below), `graphfp8.hf.CausalLM.forward` and Lightning's
`forward_context` (graphfp8/lightning.py) - which is fp8_autocast(enabled=training or eval_fp8,
recipe, fp8_group) outside any fp8_autocast region or capture; inside one, the caller's region
(or capture) decides and the carried recipe is not used. fp8_autocast pushes the FP8 context;
nothing here does.

Weights (docs/fp8.md, "The carried recipe"): a carried call given no is_first_microbatch casts
its FP8 weights, as TransformerEngine does with is_first_microbatch=None. Whatever changed the
weights since the last forward - any optimizer, fused and foreach ones included, a `.data` write,
an EMA swap, `load_state_dict`, a LoRA merge - the forward reads their current values: nothing
in between can be proven absent (fused optimizers and `.data` writes bump no version counter),
so nothing is cached across calls. A loop that knows its microbatches passes is_first_microbatch
(CausalLM.forward takes it), or graphs the whole step (make_graphed_step casts on microbatch 0
only).

Evaluation: calls in eval mode (model.eval(): evaluation, generate(), validation loops) leave the
FP8 training state as they found it: histories, scales and weight cache (modules/_context.py,
"frozen"), so training continues bit for bit as if they had not run.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from graphfp8.fp8 import scaling
from graphfp8.fp8.autocast import fp8_autocast
from graphfp8.fp8.recipe import Recipe, check_recipe
from graphfp8.modules._context import in_fp8_region
from graphfp8.modules.base import FP8Module

__all__ = ["FP8Carry", "carry", "check_not_flattened", "init_fp8_state"]


@dataclass(frozen=True)
class FP8Carry:
    """The FP8 settings a converted model carries.

    Args:
        recipe: a DelayedScaling or Float8CurrentScaling.
        fp8_group: torch.distributed group whose ranks MAX-reduce their amaxes (fp8_autocast's).
        eval_fp8: in eval mode (model.eval()) run in FP8 too; False runs evaluation in the
            parameters' dtype.
    """

    recipe: Recipe
    fp8_group: object = None
    eval_fp8: bool = True

    def __post_init__(self) -> None:
        check_recipe(self.recipe, "graphfp8: the carried recipe")
        if self.recipe is None:
            raise TypeError("graphfp8: a model carries a recipe, got None")
        if not isinstance(self.eval_fp8, bool):
            raise TypeError(f"graphfp8: eval_fp8 must be a bool, got {self.eval_fp8!r}")

    def region(self, model: torch.nn.Module | None):
        """The entrance: the fp8_autocast region of one call of `model` (None: a training call
        of a model not known yet), or none inside the caller's region or capture. Raises on
        flattened (FSDP1) weights, before any FP8 state changes."""
        if in_fp8_region():
            return contextlib.nullcontext()
        training = True if model is None else model.training
        if model is not None:
            check_not_flattened(model)
        return fp8_autocast(enabled=training or self.eval_fp8, recipe=self.recipe,
                            fp8_group=self.fp8_group)  # fmt: skip


def init_fp8_state(model: torch.nn.Module, recipe: Recipe, device) -> None:
    """Gives every FP8 layer of `model` its fresh FP8 state for `recipe` now, in arenas of its
    own (an init group of its own: another model's updates never reach them), rather than at its
    first FP8 forward: its checkpoint entry then has its final size from the start, which
    torch.distributed.checkpoint needs to load into a fresh model."""
    group = scaling.InitGroup()
    for m in model.modules():
        if isinstance(m, FP8Module) and m.uses_fp8(recipe):
            m.fp8_init(recipe, device, group)


def _first_fp8_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    return next((m for m in model.modules() if isinstance(m, FP8Module) and m.num_gemms), None)


def check_not_flattened(model: torch.nn.Module) -> None:
    """Raises if FSDP1 (FullyShardedDataParallel) flattened the weights of `model`'s first FP8
    layer: graphfp8's layers are not tested under it. FSDP2 (fully_shard, DTensor weights) is
    supported eagerly as under fp8_autocast (docs/sharding.md, "FSDP2")."""
    layer = getattr(model, "_graphfp8_first_layer", None)
    if layer is None:
        layer = _first_fp8_layer(model)
        if layer is None:
            return
        object.__setattr__(model, "_graphfp8_first_layer", layer)  # not a submodule
    weight = layer.fc1_weight if getattr(layer, "weight", None) is None else layer.weight
    if getattr(weight, "_fsdp_flattened", False) or not isinstance(weight, torch.nn.Parameter):
        raise RuntimeError(
            "graphfp8: the model's weights are flattened by FSDP1 (FullyShardedDataParallel), "
            "which graphfp8's FP8 layers do not support: shard with FSDP2 "
            "(torch.distributed.fsdp.fully_shard; docs/sharding.md), or use "
            "DistributedDataParallel and fp8_group="
        )


def carry(model: torch.nn.Module, fp8: FP8Carry) -> None:
    """Makes a model that graphfp8.convert converted in place carry `fp8`: each call of the model
    runs in fp8.region(model) (a forward pre-hook enters it, a forward hook that runs even when
    the forward raises leaves it) and its FP8 state is initialised now (init_fp8_state).

    .. warning:: graphfp8's capturers refuse modules with hooks: to graph such a model, convert
        it without a recipe and capture it with the recipe (make_graphed_step, ...).
    """
    if getattr(model, "_graphfp8_carry", None) is not None:
        raise ValueError("graphfp8: this model carries a recipe already")
    open_regions = []

    def enter(module, args) -> None:
        region = fp8.region(module)
        region.__enter__()
        open_regions.append(region)

    def leave(module, args, output) -> None:
        open_regions.pop().__exit__(None, None, None)

    handles = (model.register_forward_pre_hook(enter),
               model.register_forward_hook(leave, always_call=True))  # fmt: skip
    model._graphfp8_carry = (fp8, handles)
    param = next(model.parameters(), None)
    init_fp8_state(model, fp8.recipe, param.device if param is not None else "cpu")
