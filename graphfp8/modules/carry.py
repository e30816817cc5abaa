"""A model that carries its FP8 recipe: it enters fp8_autocast itself and decides the weight cache
itself, so that a training loop that knows nothing of FP8 (Hugging Face Trainer, accelerate,
Lightning) trains it in FP8 unchanged.

    model = g8.from_hf(hf, recipe=g8.DelayedScaling())      # or g8.convert(model, recipe=...)
    loss = model(input_ids, labels=labels).loss                # FP8, no fp8_autocast around it

Region: a forward outside any fp8_autocast region or capture enters
`fp8_autocast(enabled=training or eval_fp8, recipe, fp8_group)`; inside one, the caller's region
(or capture) decides and the carried recipe is not used.

Weight cache: a forward that the caller gives no `is_first_microbatch` casts the FP8 weights
only when they changed since the last FP8 cast, which is exactly `is_first_microbatch=True` on
the first microbatch of every optimizer step and False on the others, whatever loop runs the
microbatches. "Changed" is read off each weight's version counter (every in-place write through
torch bumps it: optimizers, load_state_dict, copy_), its storage and the recipe. A write that
bypasses the counter (`weight.data.add_(...)`) is not seen: such loops pass
`is_first_microbatch` themselves, or set weight_cache=False (every microbatch casts).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from graphfp8.fp8 import scaling
from graphfp8.fp8.autocast import fp8_autocast
from graphfp8.fp8.recipe import Recipe, check_recipe
from graphfp8.modules._context import fp8_enabled, in_fp8_region
from graphfp8.modules.base import FP8Module

__all__ = ["FP8Carry", "WeightVersions", "init_fp8_state"]


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
        return fp8_autocast(enabled=training or self.eval_fp8, recipe=self.recipe,
                            fp8_group=self.fp8_group)  # fmt: skip


class WeightVersions:
    """One model's record of the weights its FP8 cache holds (FP8Carry's weight cache)."""

    def __init__(self) -> None:
        self._cached: tuple | None = None

    def is_first_microbatch(self, weights: list[torch.Tensor], carry: FP8Carry) -> bool | None:
        """What a forward that runs now should pass as is_first_microbatch: None outside FP8 or
        without weight caching (cast every call), True when a weight or the recipe changed since
        the last FP8 forward (cast and cache), False otherwise (reuse the cache)."""
        if not fp8_enabled() or not carry.weight_cache:
            return None
        key = (carry.recipe, tuple((id(w), w.data_ptr(), w._version) for w in weights))
        first = key != self._cached
        self._cached = key
        return first

    def forget(self) -> None:
        """The next FP8 forward casts (after something changed the modules' caches)."""
        self._cached = None


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
