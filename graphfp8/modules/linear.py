"""graphfp8.Linear: y = x @ W.T + b with FP8 GEMMs under fp8_autocast."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from graphfp8.fp8.primary import make_fp8_parameter
from graphfp8.modules._blockwise import hp_or_blockwise, linear
from graphfp8.modules._functional import fp8_linear
from graphfp8.modules.base import FP8Module

__all__ = ["Linear"]


# An initialiser of a GEMM weight in place, e.g. partial(torch.nn.init.normal_, std=0.02).
InitMethod = Callable[[torch.Tensor], object]


def linear_params(
    in_features: int, out_features: int, bias: bool, dtype, device,
    init_method: InitMethod | None = None,
) -> tuple[nn.Parameter, nn.Parameter | None]:  # fmt: skip
    """(weight (out, in), bias (out,) or None). Without `init_method`, torch.nn.Linear's default
    initialisation (weight and bias uniform); with it, init_method(weight) and a zero bias, as
    TransformerEngine's layers do. The weight becomes an FP8 parameter inside fp8_model_init
    (graphfp8.fp8.primary), after its initialisation."""
    weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
    with torch.no_grad():
        if init_method is None:
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        else:
            init_method(weight)
    weight = make_fp8_parameter(weight)
    if not bias:
        return weight, None
    b = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
    if init_method is None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        nn.init.uniform_(b, -bound, bound)
    return weight, b


class Linear(FP8Module):
    """A linear layer whose three GEMMs run in FP8 inside fp8_autocast.

    Args:
        in_features: K, a multiple of 16 for FP8.
        out_features: N, a multiple of 16 for FP8.
        bias: learn an additive bias.
        params_dtype: parameter dtype (default: torch.get_default_dtype()).
        device: parameter device.
        init_method: initialises the weight in place (then the bias starts at 0), as
            TransformerEngine's argument; None: torch.nn.Linear's initialisation.
        fuse_wgrad_accumulation: TransformerEngine's option: the weight's gradient is added into
            weight.main_grad (float32, set by the caller) by the wgrad GEMM itself and the
            weight gets no .grad (docs/fp8.md, "Weight-gradient accumulation").
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 params_dtype: torch.dtype | None = None, device=None,
                 init_method: InitMethod | None = None,
                 fuse_wgrad_accumulation: bool = False):  # fmt: skip
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.weight, self.bias = linear_params(in_features, out_features, bias, dtype, device,
                                               init_method)  # fmt: skip

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """inp: (..., in_features) in params_dtype, or a Float8Tensor from a graphfp8 layer.

        is_first_microbatch: None casts the weight to FP8 every call; True casts and caches it;
        False reuses the cached FP8 weight (gradient accumulation over microbatches).
        Returns (..., out_features) in params_dtype.
        """
        cfgs = self._fp8_forward_configs(inp, self.in_features, [("weight", self.weight)],
                                         is_first_microbatch)  # fmt: skip
        if hp_or_blockwise(cfgs):
            weight = self._wgrad_weight(self.weight)
            return linear(inp, weight, self.bias, cfgs)  # blockwise FP8 or high precision
        return fp8_linear(inp, self.weight, self.bias, cfgs[0])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
