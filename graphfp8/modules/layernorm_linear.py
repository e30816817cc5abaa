"""graphfp8.LayerNormLinear: a LayerNorm (or RMSNorm) followed by an FP8 linear layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphfp8.modules._functional import fp8_linear
from graphfp8.modules._norm import apply_norm, make_norm_params
from graphfp8.modules.base import FP8Module
from graphfp8.modules.linear import linear_params

__all__ = ["LayerNormLinear"]


class LayerNormLinear(FP8Module):
    """y = Linear(Norm(x)). With fp8_output=True (under fp8_autocast) y is a Float8Tensor that a
    following graphfp8 layer consumes without casting it again.

    Args:
        in_features, out_features: multiples of 16 for FP8.
        eps: normalization epsilon.
        bias: learn the linear layer's bias.
        normalization: "LayerNorm" or "RMSNorm".
        fp8_output: return the output as a Float8Tensor (uses the output FP8 slot).
        params_dtype, device: as for Linear.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True,
                 normalization: str = "LayerNorm", fp8_output: bool = False,
                 params_dtype: torch.dtype | None = None, device=None):  # fmt: skip
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization, self.fp8_output = eps, normalization, fp8_output
        make_norm_params(self, in_features, normalization, dtype, device)
        self.weight, self.bias = linear_params(in_features, out_features, bias, dtype, device)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None):
        """inp: (..., in_features) in params_dtype. Returns (..., out_features), a Float8Tensor
        when fp8_output and FP8 are on. is_first_microbatch: as for Linear."""
        cfgs = self._fp8_forward_configs(
            inp, self.in_features, [("weight", self.weight)], is_first_microbatch,
            high_precision_input=True, fp8_output=self.fp8_output,
        )  # fmt: skip
        ln_out = apply_norm(self, inp, self.normalization, self.eps)
        if cfgs is None:
            return F.linear(ln_out, self.weight, self.bias)
        return fp8_linear(ln_out, self.weight, self.bias, cfgs[0])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"normalization={self.normalization}, fp8_output={self.fp8_output}"
        )
