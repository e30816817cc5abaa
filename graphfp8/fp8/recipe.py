"""FP8 formats and the recipes (delayed, current and blockwise scaling): frozen, validated
dataclasses."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "Format",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Float8BlockScaling",
    "Recipe",
    "check_recipe",
    "fp8_max",
    "is_blockwise",
    "is_current_scaling",
    "max_margin",
    "recipe_from_dict",
    "recipe_to_dict",
    "MAX_AMAX_HISTORY_LEN",
]

# Each slot keeps this many float32 amaxes on the device, and the fused update reads all of them
# on every step: a longer history costs memory and update time while changing no scale that a
# training run can notice (typical lengths are 16 to 1024).
MAX_AMAX_HISTORY_LEN = 1 << 16


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    if dtype == torch.float8_e4m3fn:
        return 448.0
    if dtype == torch.float8_e5m2:
        return 57344.0
    raise ValueError(f"not an FP8 dtype: {dtype}")


def max_margin(fmt: Format) -> int:
    """The largest margin for which every finite amax gives a normal float32 scale.

    The scale is S = fp8_max * 2**-margin / amax with amax <= FLT_MAX, so S >= FLT_MIN needs
    fp8_max * 2**-margin >= FLT_MAX * FLT_MIN (= 4): 6 when E4M3 is used (448 / 4 = 2**6.8),
    13 for E5M2. A smaller S is subnormal or 0, its reciprocal scale_inv overflows to inf, and
    casts produce NaN; from margin 19 on, every E4M3 cast rounds to 0 anyway.
    """
    f32 = torch.finfo(torch.float32)
    floor = f32.max * f32.tiny
    return min(math.floor(math.log2(fp8_max(d) / floor)) for d in (fmt.fwd_dtype, fmt.bwd_dtype))


class Format(enum.Enum):
    """Which FP8 format each direction uses.

    HYBRID: forward tensors (input, weight, output) E4M3, backward tensors (grads) E5M2.
    E4M3: E4M3 everywhere.
    """

    E4M3 = "E4M3"
    HYBRID = "HYBRID"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self is Format.HYBRID else torch.float8_e4m3fn


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each FP8 slot's scale comes from the amaxes of earlier steps.

    Args:
        margin: the scale is `fp8_max * 2**-margin / amax`; an integer from 0 to
            `max_margin(fp8_format)` (6 for both formats: E4M3 carries the forward tensors),
            the largest margin for which every finite amax gives a usable scale.
        fp8_format: `Format.HYBRID` or `Format.E4M3`.
        amax_history_len: how many amaxes each slot remembers, 1 to MAX_AMAX_HISTORY_LEN
            (65536).
        amax_compute_algo: "max" (max over the history) or "most_recent".
        reduce_amax: MAX-all-reduce the amaxes over `fp8_group` before each update, when a
            group with more than one rank is given.
        fp8_dpa: run dot-product attention (graphfp8.DotProductAttention, and the attention of
            TransformerLayer) in FP8 (cuDNN on the GPU), with high-precision input and output.
        fp8_mha: also keep the attention output in FP8 (a Float8Tensor) for the next layer, and
            quantize the fused QKV output once, in the rotary-embedding kernel; needs fp8_dpa.
        fp8_dpa_e4m3_bwd: run FP8 attention's backward (dO, dS, dQ, dK, dV) in E4M3 rather than
            the backward format (E5M2 under HYBRID), each at its slot's scale times E4M3's max
            over the format's (an exact power of two); needs fp8_dpa (notes/FP8_ATTENTION.md).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    fp8_dpa_e4m3_bwd: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"DelayedScaling: margin must be an int >= 0, got {self.margin!r}")
        if not isinstance(self.fp8_format, Format):
            raise ValueError(
                f"DelayedScaling: fp8_format must be a graphfp8.Format, got {self.fp8_format!r}"
            )
        limit = max_margin(self.fp8_format)
        if self.margin > limit:
            raise ValueError(
                f"DelayedScaling: margin must be <= {limit} for {self.fp8_format}, got "
                f"{self.margin}: fp8_max * 2**-margin / amax would underflow float32 for large "
                "amaxes (scale 0, scale_inv inf, NaN outputs), and from margin 19 on every E4M3 "
                "value rounds to 0"
            )
        length = self.amax_history_len
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(
                f"DelayedScaling: amax_history_len must be an int >= 1, got {length!r}"
            )
        if length > MAX_AMAX_HISTORY_LEN:
            raise ValueError(
                f"DelayedScaling: amax_history_len must be <= {MAX_AMAX_HISTORY_LEN}, got "
                f"{length}: every FP8 slot keeps that many float32 amaxes on the device "
                "(typical lengths are 16 to 1024)"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                "DelayedScaling: amax_compute_algo must be 'max' or 'most_recent', "
                f"got {self.amax_compute_algo!r}"
            )
        for name in ("reduce_amax", "fp8_dpa", "fp8_mha", "fp8_dpa_e4m3_bwd"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"DelayedScaling: {name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.fp8_mha and not self.fp8_dpa:
            raise ValueError(
                "DelayedScaling: fp8_mha=True needs fp8_dpa=True (FP8 MHA runs the attention "
                "itself in FP8)"
            )
        if self.fp8_dpa_e4m3_bwd and not self.fp8_dpa:
            raise ValueError(
                "DelayedScaling: fp8_dpa_e4m3_bwd=True needs fp8_dpa=True (it sets the format "
                "of FP8 attention's backward)"
            )


# The fields that current and blockwise scaling fix (one-long histories, margin 0, no amax
# all-reduce, no FP8 attention), so that the arenas and checkpoints treat every recipe alike.
_FIXED_FIELDS = (("margin", "int", 0), ("amax_history_len", "int", 1),
                 ("amax_compute_algo", "str", "most_recent"), ("reduce_amax", "bool", False),
                 ("fp8_dpa", "bool", False), ("fp8_mha", "bool", False),
                 ("fp8_dpa_e4m3_bwd", "bool", False))  # fmt: skip


def _fixed_fields(cls):
    """Appends _FIXED_FIELDS to cls's own fields (after them, outside __init__ and repr); runs
    before @dataclass, so the fields, their order, defaults and reprs are as if written out."""
    for name, annotation, default in _FIXED_FIELDS:
        cls.__annotations__[name] = annotation
        setattr(cls, name, field(default=default, init=False, repr=False))
    return cls


@dataclass(frozen=True)
@_fixed_fields
class Float8CurrentScaling:
    """Current (per-tensor, just-in-time) scaling: each cast takes its scale from the tensor it
    casts, with no history (TransformerEngine's Float8CurrentScaling, torchao's tensorwise).

    Every cast of activations, weights and gradients first folds max|x| into its slot's amax
    (one extra pass over x, on the device), then sets the slot's scale exactly as a delayed-scaling
    update of a one-long history does: `scale = fp8_max / amax` when amax is finite and > 0 (an
    infinite result becomes FLT_MAX), else the slot keeps its previous scale (1 initially), so
    zero, inf and NaN tensors are handled as DelayedScaling handles them. No fused arena update
    and no amax all-reduce run (each rank scales its own tensors; weights match across data
    parallel ranks anyway). FP8 attention (fp8_dpa, fp8_mha) is DelayedScaling only.

    Args:
        fp8_format: `Format.HYBRID` or `Format.E4M3`.

    The other fields are fixed, so that the arenas (one-long histories, margin 0) and
    checkpoints treat both recipes alike.
    """

    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        if not isinstance(self.fp8_format, Format):
            raise ValueError(
                "Float8CurrentScaling: fp8_format must be a graphfp8.Format, got "
                f"{self.fp8_format!r}"
            )


@dataclass(frozen=True)
@_fixed_fields
class Float8BlockScaling:
    """Blockwise scaling (DeepSeek-V3's recipe; TransformerEngine's Float8BlockScaling):
    activations and gradients quantized in 1x128 tiles along each GEMM's K, weights in 128x128
    blocks, each tile's or block's scale computed from its own amax at the cast (no history, no
    slots, no arena, no amax all-reduce). docs/fp8.md, "Blockwise scaling", has the exact rules.

    Args:
        fp8_format: `Format.E4M3` (E4M3 everywhere, as DeepSeek-V3 and TE use it).
        x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 (1x128 tiles) or 2
            (128x128 blocks) for inputs, weights and gradients; graphfp8 implements TE's
            defaults 1, 2, 1.
        power_2_scale: round each scale down to a power of 2 (TE's default); False keeps the
            float32 scale fp8_max / amax (TE's NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1).

    The other fields are fixed, as Float8CurrentScaling's are.
    """

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    power_2_scale: bool = True

    def __post_init__(self) -> None:
        if self.fp8_format is not Format.E4M3:
            raise ValueError(
                f"Float8BlockScaling: fp8_format must be Format.E4M3, got {self.fp8_format!r} "
                "(blockwise scaling quantizes gradients in E4M3 too: its tiles keep their range)"
            )
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        if dims != (1, 2, 1):
            raise ValueError(
                "Float8BlockScaling: graphfp8 implements x_block_scaling_dim=1, "
                "w_block_scaling_dim=2, grad_block_scaling_dim=1 (1x128 activation and gradient "
                f"tiles, 128x128 weight blocks: TE's defaults), got {dims}"
            )
        if not isinstance(self.power_2_scale, bool):
            raise ValueError(
                f"Float8BlockScaling: power_2_scale must be a bool, got {self.power_2_scale!r}"
            )


Recipe = DelayedScaling | Float8CurrentScaling | Float8BlockScaling
_RECIPES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling)


def is_current_scaling(recipe) -> bool:
    """Whether casts under `recipe` take their scale from the tensor they cast."""
    return isinstance(recipe, Float8CurrentScaling)


def is_blockwise(recipe) -> bool:
    """Whether `recipe` scales per 1x128 tile and 128x128 block (Float8BlockScaling)."""
    return isinstance(recipe, Float8BlockScaling)


def check_recipe(recipe, where: str) -> None:
    """Raises a TypeError naming `where` unless `recipe` is None or a graphfp8 recipe."""
    if recipe is not None and not isinstance(recipe, _RECIPES):
        raise TypeError(
            f"{where}: recipe must be a graphfp8.DelayedScaling, graphfp8.Float8CurrentScaling "
            f"or graphfp8.Float8BlockScaling, got {recipe!r}"
        )


def recipe_to_dict(recipe: Recipe) -> dict:
    """A checkpointable dict of plain values; a DelayedScaling's has no "type" key (the layout
    that checkpoints written before Float8CurrentScaling existed hold)."""
    if isinstance(recipe, Float8CurrentScaling):
        return {"type": "Float8CurrentScaling", "fp8_format": recipe.fp8_format.value}
    if isinstance(recipe, Float8BlockScaling):
        return {"type": "Float8BlockScaling", "fp8_format": recipe.fp8_format.value,
                "power_2_scale": recipe.power_2_scale}  # fmt: skip
    return {
        "margin": recipe.margin,
        "fp8_format": recipe.fp8_format.value,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo,
        "reduce_amax": recipe.reduce_amax,
        "fp8_dpa": recipe.fp8_dpa,
        "fp8_mha": recipe.fp8_mha,
    }


def recipe_from_dict(state: dict) -> Recipe:
    """Inverse of recipe_to_dict; raises TypeError/KeyError/ValueError for an invalid dict."""
    state = dict(state)
    kind = state.pop("type", "DelayedScaling")
    state["fp8_format"] = Format(state["fp8_format"])
    if kind == "Float8CurrentScaling":
        return Float8CurrentScaling(**state)
    if kind == "Float8BlockScaling":
        return Float8BlockScaling(**state)
    if kind != "DelayedScaling":
        raise ValueError(f"unknown recipe type {kind!r}")
    return DelayedScaling(**state)
