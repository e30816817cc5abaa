"""FP8 primary weights: fp8_model_init, and the quantization of a high-precision weight into an
FP8 parameter (a Float8Tensor: data, private scale_inv, lazy transpose cache).

A weight is quantized with current scaling (docs/fp8.md, "FP8 primary weights"): its scale is
fp8_max / max|w|, computed on the device from the weight itself (kept when that amax is 0 or
inf), whatever recipe the forward later runs under. The forward uses the FP8 data directly and
builds the transpose lazily: eagerly when the cache is stale or `is_first_microbatch` is True or
None, in graphs as a node guarded by the weight-cache flag, so it runs on the first microbatch of
every replayed step.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from graphfp8 import ops
from graphfp8.fp8.recipe import DelayedScaling, Recipe, check_recipe, fp8_max
from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["INIT", "WeightQuantizer", "fp8_model_init", "make_fp8_parameter", "quantize_weight"]

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _InitState:
    """What the innermost fp8_model_init says."""

    def __init__(self) -> None:
        self.enabled = False
        self.recipe: Recipe | None = None


INIT = _InitState()


@contextlib.contextmanager
def fp8_model_init(enabled: bool = True, recipe: Recipe | None = None):
    """graphfp8 layers created inside hold their GEMM weights as FP8 parameters.

    Linear, LayerNormLinear, LayerNormMLP (and TransformerLayer, built from them) store each
    weight as a Float8Tensor parameter of the recipe's forward FP8 format (E4M3): FP8 data, its
    private scale_inv and a transpose cache, 2 bytes per element instead of the 4 of a bf16
    weight plus its FP8 workspace. Biases and norm weights stay in params_dtype. Such layers run
    only under fp8_autocast; train them through graphfp8.MasterWeights (fp32 masters).

    Args:
        enabled: False creates ordinary high-precision weights.
        recipe: DelayedScaling or Float8CurrentScaling (DelayedScaling() when None); it only
            picks the FP8 format.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_model_init: enabled must be a bool, got {enabled!r}")
    check_recipe(recipe, "fp8_model_init")
    prev = (INIT.enabled, INIT.recipe)
    INIT.enabled, INIT.recipe = enabled, recipe or DelayedScaling()
    try:
        yield
    finally:
        INIT.enabled, INIT.recipe = prev


class WeightQuantizer:
    """Persistent device buffers of one FP8 weight's quantization (capturable: no allocation,
    no host work): amax (1, 1), scale (1,), scaled_max (1,) float32, and an amax sink."""

    def __init__(self, fp8_dtype: torch.dtype, device) -> None:
        self.fp8_dtype = fp8_dtype
        self.amax = torch.zeros(1, 1, dtype=torch.float32, device=device)
        self.scale = torch.ones(1, dtype=torch.float32, device=device)
        self.scaled_max = torch.full((1,), fp8_max(fp8_dtype), dtype=torch.float32, device=device)
        self.sink = torch.zeros(1, dtype=torch.float32, device=device)

    def quantize_(self, hp: torch.Tensor, dst: Float8Tensor) -> None:
        """dst <- hp in FP8 with scale fp8_max / max|hp|, and its transpose cache marked stale.

        Args:
            hp: dst's shape, float32/bfloat16/float16, contiguous (an fp32 master, say).
            dst: the FP8 parameter; its data and scale_inv are rewritten in place.
        """
        ops.cast_to_fp8(hp, self.scale, self.amax[0], self.fp8_dtype)  # the amax pass
        ops.scale_update_(self.amax, self.scale, self.scaled_max, True)
        ops.cast_to_fp8(hp, self.scale, self.sink, self.fp8_dtype, out=dst._data,
                        scale_inv=dst._scale_inv)  # fmt: skip
        dst.mark_data_changed(transpose_written=False)


def quantize_weight(hp: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> Float8Tensor:
    """A new 2-D Float8Tensor (with room for its transpose) holding hp quantized.

    Args:
        hp: (rows, cols) float32/bfloat16/float16; its dtype becomes the nominal dtype.
        fp8_dtype: torch.float8_e4m3fn (weights) or torch.float8_e5m2.
    """
    if hp.dtype not in HP_DTYPES or hp.dim() != 2:
        raise TypeError(
            "FP8 primary weights need a 2-D float32, bfloat16 or float16 weight (params_dtype), "
            f"got {tuple(hp.shape)} {hp.dtype}"
        )
    f8 = Float8Tensor.empty(tuple(hp.shape), fp8_dtype, hp.dtype, hp.device)
    WeightQuantizer(fp8_dtype, hp.device).quantize_(hp.detach().contiguous(), f8)
    return f8


def make_fp8_parameter(weight: torch.Tensor) -> nn.Parameter:
    """The weight as an FP8 parameter when inside fp8_model_init(enabled=True), else unchanged.

    weight: (out, in) high-precision parameter, already initialised.
    """
    if not INIT.enabled:
        return weight
    f8 = quantize_weight(weight, INIT.recipe.fp8_format.fwd_dtype)
    return nn.Parameter(f8, requires_grad=weight.requires_grad)
