"""A graphfp8 layer's FP8 state as one float32 tensor, the form `get_extra_state` returns.

Every checkpoint format takes a tensor (safetensors, Hugging Face's save_pretrained, Trainer and
accelerate checkpoints, torch.distributed.checkpoint, torch.load(weights_only=True)); the dicts
of versions 0 and 1 only went through pickle. Layout (version 2), float32 throughout, so
histories and scales copy bit for bit (NaN and inf included):

    [0]      MAGIC
    [1]      version (2)
    [2:10]   the recipe: kind (0 DelayedScaling, 1 Float8CurrentScaling), fp8_format
             (0 HYBRID, 1 E4M3), margin, amax_history_len L, amax_compute_algo (0 max,
             1 most_recent), reduce_amax, fp8_dpa, fp8_mha
    [10:12]  forward slots F, backward slots B
    then     forward amax history (L, F) row-major, forward scale (F,),
             backward amax history (L, B), backward scale (B,)

A module with no FP8 state (it has not run in FP8) saves [MAGIC, version] alone (NONE), not an
empty tensor: safetensors writers that drop tensors sharing storage (accelerate's save_model,
Hugging Face's save_pretrained) take every empty tensor for a shared one. The size depends only
on the recipe's history length and the module's slots, so a fresh module carrying its recipe
(torch.distributed.checkpoint loads into the tensors of a state_dict) has the size to load into.
"""

from __future__ import annotations

import torch

from graphfp8.fp8.recipe import Recipe, recipe_from_dict, recipe_to_dict

__all__ = ["TENSOR_VERSION", "decode", "encode", "is_empty", "none"]

MAGIC = 26616.0  # 0x67F8, "g8": what tells graphfp8's tensor from another one
TENSOR_VERSION = 2
_HEADER = 12
_FORMATS = ("HYBRID", "E4M3")
_ALGOS = ("max", "most_recent")
_KINDS = ("DelayedScaling", "Float8CurrentScaling")


def none() -> torch.Tensor:
    """The version-2 tensor of a module without FP8 state."""
    return torch.tensor([MAGIC, TENSOR_VERSION], dtype=torch.float32)


def is_empty(state) -> bool:
    """A saved 'no FP8 state': None (versions 0 and 1), none() or an empty tensor."""
    if state is None:
        return True
    if not torch.is_tensor(state) or state.numel() > 2:
        return False
    return state.numel() == 0 or state.tolist() == [MAGIC, TENSOR_VERSION]


def encode(recipe: Recipe, fwd_history, fwd_scale, bwd_history, bwd_scale) -> torch.Tensor:
    """The version-2 tensor of one module's FP8 state (copies; on the histories' device).

    Args:
        recipe: the recipe the state belongs to.
        fwd_history, bwd_history: (L, F) and (L, B) float32 amax histories.
        fwd_scale, bwd_scale: (F,) and (B,) float32 scales.
    """
    fields = recipe_to_dict(recipe)
    kind = _KINDS.index(fields.get("type", "DelayedScaling"))
    header = [MAGIC, TENSOR_VERSION, kind, _FORMATS.index(recipe.fp8_format.value),
              recipe.margin, recipe.amax_history_len, _ALGOS.index(recipe.amax_compute_algo),
              recipe.reduce_amax, recipe.fp8_dpa, recipe.fp8_mha, fwd_scale.numel(),
              bwd_scale.numel()]  # fmt: skip
    device = fwd_history.device
    parts = [torch.tensor(header, dtype=torch.float32, device=device)]
    parts += [t.detach().float().reshape(-1) for t in (fwd_history, fwd_scale, bwd_history,
                                                       bwd_scale)]  # fmt: skip
    return torch.cat(parts)


def _field(header: list[float], i: int, names: tuple[str, ...], what: str, where: str) -> str:
    code = header[i]
    if code not in range(len(names)):
        raise ValueError(f"{where} holds an invalid {what} code {code!r}")
    return names[int(code)]


def _recipe(header: list[float], where: str) -> Recipe:
    kind = _field(header, 2, _KINDS, "recipe kind", where)
    fmt = _field(header, 3, _FORMATS, "fp8_format", where)
    if kind == "Float8CurrentScaling":
        return recipe_from_dict({"type": kind, "fp8_format": fmt})
    values = {"fp8_format": fmt, "margin": int(header[4]), "amax_history_len": int(header[5]),
              "amax_compute_algo": _field(header, 6, _ALGOS, "amax_compute_algo", where),
              "reduce_amax": bool(header[7]), "fp8_dpa": bool(header[8]),
              "fp8_mha": bool(header[9])}  # fmt: skip
    if any(float(values[k]) != header[i] for k, i in (("margin", 4), ("amax_history_len", 5))):
        raise ValueError(f"{where} holds a non-integer margin or history length {header[4:6]}")
    if any(header[i] not in (0.0, 1.0) for i in (7, 8, 9)):
        raise ValueError(f"{where} holds non-boolean recipe flags {header[7:10]}")
    try:
        return recipe_from_dict(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} holds an invalid recipe {values}: {exc}") from exc


def decode(state: torch.Tensor, where: str) -> dict:
    """The dict form of a version-2 tensor: {"version": 2, "recipe": a recipe object,
    "fwd_amax_history", "fwd_scale", "bwd_amax_history", "bwd_scale"} (views of `state`).

    Raises:
        ValueError naming `where`: not graphfp8's tensor, a newer version (which one), an
        invalid recipe or a size that does not match the header.
    """
    if state.dtype != torch.float32 or state.dim() != 1 or state.numel() < _HEADER:
        raise ValueError(
            f"{where} is not one that graphfp8 wrote: expected a 1-D float32 tensor of at least "
            f"{_HEADER} values, got {state.dtype} {tuple(state.shape)}"
        )
    header = state[:_HEADER].tolist()
    if header[0] != MAGIC:
        raise ValueError(f"{where} is not one that graphfp8 wrote (its first value is not {MAGIC})")
    if header[1] != TENSOR_VERSION:
        raise ValueError(
            f"{where} was written in checkpoint format version {header[1]:g}; this graphfp8 reads "
            f"versions 0 to {TENSOR_VERSION} (a newer graphfp8 wrote it: load it with that one)"
        )
    recipe = _recipe(header, where)
    length, fwd, bwd = recipe.amax_history_len, int(header[10]), int(header[11])
    sizes = [length * fwd, fwd, length * bwd, bwd]
    if header[10] != fwd or header[11] != bwd or fwd < 0 or bwd < 0:
        raise ValueError(f"{where} holds invalid slot counts {header[10:12]}")
    if state.numel() != _HEADER + sum(sizes):
        raise ValueError(
            f"{where} holds {state.numel()} values; its header (history length {length}, "
            f"{fwd} forward and {bwd} backward slots) says {_HEADER + sum(sizes)}"
        )
    fh, fs, bh, bs = state[_HEADER:].split(sizes)
    return {"version": TENSOR_VERSION, "recipe": recipe, "fwd_amax_history": fh.view(length, fwd),
            "fwd_scale": fs, "bwd_amax_history": bh.view(length, bwd),
            "bwd_scale": bs}  # fmt: skip
