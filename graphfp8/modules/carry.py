"""A model that carries its FP8 recipe: it enters fp8_autocast itself and decides the weight cache
itself, so that a training loop that knows nothing of FP8 (Hugging Face Trainer, accelerate,
Lightning) trains it in FP8 unchanged.

    model = g8.from_hf(hf, recipe=g8.DelayedScaling())      # or g8.convert(model, recipe=...)
    loss = model(input_ids, labels=labels).loss                # FP8, no fp8_autocast around it

Region: a forward outside any fp8_autocast region or capture enters
`fp8_autocast(enabled=training or eval_fp8, recipe, fp8_group)`; inside one, the caller's region
(or capture) decides and the carried recipe is not used.

Weight cache: inside the carried region a layer called without `is_first_microbatch` casts its
FP8 weights only when they changed since its last cast (graphfp8/fp8/weight_cache.py,
VersionCasts): exactly is_first_microbatch=True on the first microbatch of every optimizer step
and False on the others, whatever loop runs the microbatches. A write that bypasses the version
counter (`weight.data.add_(...)`) is not seen: such loops pass `is_first_microbatch`
themselves, or set weight_cache=False (every microbatch casts).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from graphfp8.fp8 import context, scaling
from graphfp8.fp8.autocast import fp8_autocast
from graphfp8.fp8.recipe import Recipe, check_recipe
from graphfp8.fp8.weight_cache import VersionCasts
from graphfp8.modules._context import in_fp8_region
from graphfp8.modules.base import FP8Module

__all__ = ["FP8Carry", "carry", "check_not_sharded", "init_fp8_state"]


@dataclass(frozen=True)
class FP8Carry:
    """The FP8 settings a converted model carries.

    Args:
        recipe: a DelayedScaling or Float8CurrentScaling.
        fp8_group: torch.distributed group whose ranks MAX-reduce their amaxes (fp8_autocast's).
        eval_fp8: in eval mode (model.eval()) run in FP8 too; False runs evaluation in the
            parameters' dtype.
        weight_cache: cast the FP8 weights only when they changed (module docstring); False casts
            them on every forward.
    """

    recipe: Recipe
    fp8_group: object = None
    eval_fp8: bool = True
    weight_cache: bool = True

    def __post_init__(self) -> None:
        check_recipe(self.recipe, "graphfp8: the carried recipe")
        if self.recipe is None:
            raise TypeError("graphfp8: a model carries a recipe, got None")
        for name in ("eval_fp8", "weight_cache"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"graphfp8: {name} must be a bool, got {getattr(self, name)!r}")

    def region(self, training: bool):
        """The fp8_autocast region of one forward (none inside the caller's region or capture)."""
        if in_fp8_region():
            return contextlib.nullcontext()
        return _carried(self, training)


@contextlib.contextmanager
def _carried(carry: FP8Carry, training: bool):
    enabled = training or carry.eval_fp8
    with fp8_autocast(enabled=enabled, recipe=carry.recipe, fp8_group=carry.fp8_group):
        if not (enabled and carry.weight_cache):
            yield
            return
        ctx = dataclasses.replace(context.current(), weight_cache=VersionCasts())
        with context.pushed(ctx):
            yield


def init_fp8_state(model: torch.nn.Module, recipe: Recipe, device) -> None:
    """Gives every FP8 layer of `model` its fresh FP8 state for `recipe` now, in arenas of its
    own (a new init group: another model's updates never reach them), rather than at its first
    FP8 forward: its checkpoint entry then has its final size from the start, which
    torch.distributed.checkpoint needs to load into a fresh model."""
    scaling.new_init_group()
    for m in model.modules():
        if isinstance(m, FP8Module) and m.uses_fp8(recipe):
            m.fp8_init(recipe, device)
    scaling.new_init_group()


def check_not_sharded(modules, weight) -> None:
    """Raises if FSDP shards the model (`modules`: the model and one FP8 layer, `weight` that
    layer's weight; checked on every carried call): graphfp8's FP8 layers, their FP8 state and
    checkpoints are not tested under it. FSDP2 (fully_shard) turns the module into an FSDPModule
    and its weights into DTensors; FSDP1 flattens them."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if (
        any(isinstance(m, FSDPModule) for m in modules)
        or isinstance(weight, DTensor)
        or getattr(weight, "_fsdp_flattened", False)
        or not isinstance(weight, torch.nn.Parameter)
    ):
        raise RuntimeError(
            "graphfp8: the model's weights are sharded (FSDP, torch.distributed.fsdp), which "
            "graphfp8's FP8 layers do not support: use DistributedDataParallel (accelerate's "
            "multi-GPU default) and fp8_group=, or graphfp8.distributed.allreduce_gradients"
        )


def _first_fp8_weight(model: torch.nn.Module) -> torch.nn.Module | None:
    return next((m for m in model.modules() if isinstance(m, FP8Module) and m.num_gemms), None)


def carry(model: torch.nn.Module, fp8: FP8Carry) -> None:
    """Makes a model that graphfp8.convert converted in place carry `fp8`: each call of the model
    runs in its region (a forward pre-hook enters it, a forward hook that runs even when the
    forward raises leaves it) and its FP8 state is initialised now (init_fp8_state).

    .. warning:: graphfp8's capturers refuse modules with hooks: to graph such a model, convert
        it without a recipe and capture it with the recipe (make_graphed_step, ...).
    """
    if getattr(model, "_graphfp8_carry", None) is not None:
        raise ValueError("graphfp8: this model carries a recipe already")
    open_regions, layer = [], _first_fp8_weight(model)

    def enter(module, args) -> None:
        if layer is not None:
            weight = getattr(layer, "weight", None)
            check_not_sharded((module, layer), layer.fc1_weight if weight is None else weight)
        region = fp8.region(module.training)
        region.__enter__()
        open_regions.append(region)

    def leave(module, args, output) -> None:
        open_regions.pop().__exit__(None, None, None)

    handles = (model.register_forward_pre_hook(enter),
               model.register_forward_hook(leave, always_call=True))  # fmt: skip
    model._graphfp8_carry = (fp8, handles)
    param = next(model.parameters(), None)
    init_fp8_state(model, fp8.recipe, param.device if param is not None else "cpu")
