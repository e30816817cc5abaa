"""FP8 primary weights: fp8_model_init, and the quantization of a high-precision weight into an
FP8 parameter (a Float8Tensor: data, private scale_inv, lazy transpose cache).

A weight is quantized with current scaling (docs/fp8.md, "FP8 primary weights"): its scale is
fp8_max / max|w|, computed on the device from the weight itself (kept when that amax is 0 or
inf), whatever per-tensor recipe the forward later runs under. Under fp8_model_init(recipe=
Float8BlockScaling()) a weight is stored in 128x128 blocks instead (a Float8BlockTensor, each
block's scale from its own amax: graphfp8/ops/blockwise.py), exactly what that recipe's forward
would quantize a high-precision weight into, and runs only under Float8BlockScaling.

The per-tensor forward uses the FP8 data directly and builds the transpose lazily: eagerly when
the cache is stale or `is_first_microbatch` is True or None, in graphs as a node guarded by the
weight-cache flag, so it runs on the first microbatch of every replayed step.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from graphfp8 import ops
from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.recipe import DelayedScaling, Recipe, check_recipe, fp8_max, is_blockwise
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.ops.blockwise import quantize_blocks

__all__ = ["INIT", "BlockWeightQuantizer", "WeightQuantizer", "fp8_model_init",
           "make_fp8_parameter", "quantize_block_weight", "quantize_weight",
           "quantizer_for"]  # fmt: skip

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
        recipe: DelayedScaling or Float8CurrentScaling (DelayedScaling() when None): it only
            picks the FP8 format; Float8BlockScaling: the weights are stored in 128x128 blocks
            (Float8BlockTensor, with the recipe's power_2_scale) and run under that recipe only.
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

    def tensors(self) -> list[torch.Tensor]:
        """What a write-back changes besides the weight (a graph capture snapshots it)."""
        return [self.scale]


class BlockWeightQuantizer:
    """The quantization of one blockwise FP8 weight (a Float8BlockTensor): each 128x128 block
    of the high-precision value with the scale of its own amax, no state of its own."""

    def quantize_(self, hp: torch.Tensor, dst: Float8BlockTensor) -> None:
        """dst <- hp in 128x128 blocks (data and block scales rewritten in place).

        Args:
            hp: dst's shape (N, K), float32/bfloat16/float16 (an fp32 master, say).
            dst: the blockwise FP8 parameter.
        """
        data, scale_inv = quantize_blocks(hp, dst.fp8_dtype, dst._power_2_scale)
        dst._data.copy_(data)
        dst._scale_inv.copy_(scale_inv)

    def tensors(self) -> list[torch.Tensor]:
        return []


def quantizer_for(weight: Float8Tensor) -> WeightQuantizer | BlockWeightQuantizer:
    """The quantizer that writes `weight` from its master: per tensor or per block."""
    if isinstance(weight, Float8BlockTensor):
        return BlockWeightQuantizer()
    return WeightQuantizer(weight.fp8_dtype, weight.device)


def quantize_block_weight(hp: torch.Tensor, power_2_scale: bool = True) -> Float8BlockTensor:
    """A new Float8BlockTensor holding hp (N, K) quantized in 128x128 blocks (E4M3)."""
    _check_hp(hp)
    f8 = Float8BlockTensor.empty(tuple(hp.shape), hp.dtype, hp.device, power_2_scale)
    BlockWeightQuantizer().quantize_(hp.detach(), f8)
    return f8


def _check_hp(hp: torch.Tensor) -> None:
    if hp.dtype not in HP_DTYPES or hp.dim() != 2:
        raise TypeError(
            "FP8 primary weights need a 2-D float32, bfloat16 or float16 weight (params_dtype), "
            f"got {tuple(hp.shape)} {hp.dtype}"
        )


def quantize_weight(hp: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> Float8Tensor:
    """A new 2-D Float8Tensor (with room for its transpose) holding hp quantized.

    Args:
        hp: (rows, cols) float32/bfloat16/float16; its dtype becomes the nominal dtype.
        fp8_dtype: torch.float8_e4m3fn (weights) or torch.float8_e5m2.
    """
    _check_hp(hp)
    f8 = Float8Tensor.empty(tuple(hp.shape), fp8_dtype, hp.dtype, hp.device)
    WeightQuantizer(fp8_dtype, hp.device).quantize_(hp.detach().contiguous(), f8)
    return f8


def make_fp8_parameter(weight: torch.Tensor) -> nn.Parameter:
    """The weight as an FP8 parameter when inside fp8_model_init(enabled=True), else unchanged.

    weight: (out, in) high-precision parameter, already initialised.
    """
    if not INIT.enabled:
        return weight
    if is_blockwise(INIT.recipe):
        f8 = quantize_block_weight(weight, INIT.recipe.power_2_scale)
        return nn.Parameter(f8, requires_grad=weight.requires_grad)
    f8 = quantize_weight(weight, INIT.recipe.fp8_format.fwd_dtype)
    return nn.Parameter(f8, requires_grad=weight.requires_grad)
