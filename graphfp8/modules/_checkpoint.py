"""A graphfp8 layer's checkpointed FP8 state (`_extra_state`): its layout, older versions, and
the checks a layer runs on a checkpoint before it writes any of it (FP8Module's load)."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from graphfp8.fp8.recipe import DelayedScaling, Float8CurrentScaling, Recipe, recipe_from_dict
from graphfp8.fp8.slots import BwdRole, slot_index
from graphfp8.modules import _state_tensor

__all__ = ["EXTRA_STATE_VERSION", "check_extra_state", "format_move_error", "shape_errors"]

# _extra_state layout: 0 (a dict without a "version" key) held 2 backward slots per GEMM
# (grad_output and an unused grad_input); 1 (a dict) holds the slots of graphfp8.fp8.slots; 2 is
# the same as one float32 tensor (modules/_state_tensor.py), which every checkpoint format takes.
EXTRA_STATE_VERSION = _state_tensor.TENSOR_VERSION
_EXTRA_KEYS = ("recipe", "fwd_amax_history", "fwd_scale", "bwd_amax_history", "bwd_scale")
_TENSOR_KEYS = _EXTRA_KEYS[1:]


def _upgrade(state, where: str, num_gemms: int) -> dict:
    """Validates the layout of a checkpoint's FP8 state and brings it to EXTRA_STATE_VERSION's
    dict form, whose "recipe" is a recipe object. Version 0 had a second backward slot per GEMM,
    dropped here."""
    if torch.is_tensor(state):
        return _state_tensor.decode(state, where)
    if not isinstance(state, dict) or any(k not in state for k in _EXTRA_KEYS):
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{where} is not one that graphfp8 wrote: expected a float32 tensor or a dict with "
            f"keys {list(_EXTRA_KEYS)}, got {found}"
        )
    version = state.get("version", 0)
    if version not in range(EXTRA_STATE_VERSION + 1):
        raise ValueError(
            f"{where} has version {version!r}; this graphfp8 reads versions 0 to "
            f"{EXTRA_STATE_VERSION}"
        )
    kinds = {k: type(state[k]).__name__ for k in _TENSOR_KEYS if not torch.is_tensor(state[k])}
    if kinds:
        raise ValueError(f"{where} holds non-tensors {kinds}")
    try:  # a recipe object (set by hand) is taken as it is
        recipe = state["recipe"]
        if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
            recipe = recipe_from_dict(recipe)
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"{where} holds an invalid recipe {state['recipe']!r}: {exc}") from exc
    state = {**state, "recipe": recipe}
    if version == 0:  # backward slots were (grad_output, grad_input) per GEMM
        old = 2 * num_gemms
        keep = [2 * g + slot_index(BwdRole.GRAD_OUTPUT, 0) for g in range(num_gemms)]
        history, scale = state["bwd_amax_history"], state["bwd_scale"]
        if history.dim() != 2 or history.shape[1] != old or scale.shape != (old,):
            raise ValueError(
                f"{where} (version 0) has backward history {tuple(history.shape)} and scale "
                f"{tuple(scale.shape)}; a module with {num_gemms} GEMMs had {old} slots"
            )
        state["bwd_amax_history"], state["bwd_scale"] = history[:, keep], scale[keep]
    return state


def format_move_error(old: Recipe, new: Recipe, bwd_history, bwd_scale) -> str | None:
    """Why FP8 state of recipe `old` cannot move to `new`, or None. Delayed scaling runs each
    backward on the scales of the last update, computed for the old recipe's gradient format
    (HYBRID: E5M2, max 57344; E4M3: max 448): moved, the first backward saturates (or underflows)
    its gradients. State that never ran a backward (zero history, unit scales) moves freely.

    Args:
        bwd_history: (L, B) float32 backward amax history; bwd_scale: (B,) float32 scales.
    """
    if not isinstance(new, DelayedScaling) or old.fp8_format == new.fp8_format:
        return None
    if not (bool(bwd_history.any()) or bool((bwd_scale != 1).any())):
        return None
    return (
        f"its FP8 state holds fp8_format={old.fp8_format.value} scales, and "
        f"{new.fp8_format.value} would run its first backward on "
        f"{old.fp8_format.value}'s gradient scales (they saturate or underflow: no exact "
        "conversion exists); use the recipe of that state, or start from fresh FP8 "
        "state (load the checkpoint without its `_extra_state` entries)"
    )


def _check_recipe(module, recipe: Recipe, where: str, state: dict) -> None:
    """The module's FP8 state can take the checkpoint's recipe (FP8Module.fp8_init's rules)."""
    meta = module.fp8_meta
    if meta is None or meta.recipe == recipe:
        return
    moved = format_move_error(recipe, meta.recipe, state["bwd_amax_history"], state["bwd_scale"])
    if moved is not None:
        raise ValueError(f"{where}: the module runs {meta.recipe}; {moved}")
    if meta.recipe.amax_history_len != recipe.amax_history_len:
        raise ValueError(
            f"{where} has amax_history_len={recipe.amax_history_len}, the module's FP8 state "
            f"has {meta.recipe.amax_history_len}; history lengths cannot change: load it into "
            "a module that has not run in FP8 yet (or run this one with the checkpoint's recipe)"
        )
    if meta.fwd.arena.frozen:
        raise RuntimeError(
            f"{where} was written under {recipe}; the module's FP8 state is captured in a "
            f"graph for {meta.recipe} and cannot move to it"
        )


def check_extra_state(module, state, name: str) -> dict:
    """Checks a checkpoint's FP8 state against `module` before anything is written: layout,
    version, recipe (the history length the module's state can take) and every shape.

    Args:
        module: the FP8Module about to load it.
        state: the checkpoint's `_extra_state` entry (not None).
        name: the module, as error messages name it.

    Returns:
        The state at EXTRA_STATE_VERSION, its "recipe" a recipe object.

    Raises:
        ValueError (RuntimeError for a captured module's recipe), naming the module.
    """
    where = f"{name}: the checkpoint's FP8 state (_extra_state)"
    state = _upgrade(state, where, module.num_gemms)
    recipe = state["recipe"]
    _check_recipe(module, recipe, where, state)
    length = recipe.amax_history_len
    for key, count in zip(("fwd", "bwd"), module._slot_counts(), strict=True):
        history, scale = state[f"{key}_amax_history"], state[f"{key}_scale"]
        if tuple(history.shape) != (length, count) or tuple(scale.shape) != (count,):
            raise ValueError(
                f"{where} has {key} amax history {tuple(history.shape)} and scale "
                f"{tuple(scale.shape)}; this module's are ({length}, {count}) and ({count},)"
            )
    return state


def shape_errors(module: nn.Module, state_dict: dict, prefix: str) -> list[str]:
    """torch's "size mismatch" messages for the module's own parameters and persistent buffers
    whose checkpoint entries have another shape."""
    own = itertools.chain(
        module._parameters.items(),
        ((n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set),
    )
    errors = []
    for name, t in own:
        entry = state_dict.get(prefix + name)
        if t is not None and torch.is_tensor(entry) and entry.shape != t.shape:
            errors.append(
                f"size mismatch for {prefix + name}: copying a param with shape "
                f"{tuple(entry.shape)} from checkpoint, the shape in current model is "
                f"{tuple(t.shape)} (nothing of {prefix[:-1] or 'the module'} was loaded)"
            )
    return errors
