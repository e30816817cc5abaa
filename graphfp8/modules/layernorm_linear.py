"""graphfp8.LayerNormLinear: a LayerNorm (or RMSNorm) followed by an FP8 linear layer; under
fp8_autocast the norm writes the GEMM's FP8 input directly (graphfp8.modules._norm)."""

from __future__ import annotations

from functools import partial

import torch

from graphfp8.fp8.slots import FwdRole
from graphfp8.modules._blockwise import hp_or_blockwise, linear
from graphfp8.modules._blockwise_norm import fused_norm_linear, norm_linear
from graphfp8.modules._blockwise_plain import plain_norm, plain_on
from graphfp8.modules._functional import fp8_linear
from graphfp8.modules._norm import NormSpec, apply_norm, make_norm_params, norm_fp8
from graphfp8.modules._qkv_rope import fp8_linear_rope
from graphfp8.modules.base import FP8Module
from graphfp8.modules.linear import InitMethod, linear_params

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
        zero_centered_gamma: the norm's weight is 1 + layer_norm_weight, which starts at 0.
        return_layernorm_output: also return the norm's output (high precision).
        params_dtype, device, init_method, fuse_wgrad_accumulation: as for Linear.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True,
                 normalization: str = "LayerNorm", fp8_output: bool = False,
                 zero_centered_gamma: bool = False, return_layernorm_output: bool = False,
                 params_dtype: torch.dtype | None = None, device=None,
                 init_method: InitMethod | None = None,
                 fuse_wgrad_accumulation: bool = False):  # fmt: skip
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.eps, self.normalization, self.fp8_output = eps, normalization, fp8_output
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        make_norm_params(self, in_features, normalization, dtype, device, zero_centered_gamma)
        self.weight, self.bias = linear_params(in_features, out_features, bias, dtype, device,
                                               init_method)  # fmt: skip

    @property
    def norm_spec(self) -> NormSpec:
        return NormSpec(self.normalization, self.eps, self.zero_centered_gamma)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                residual: torch.Tensor | None = None, rope: tuple | None = None):  # fmt: skip
        """inp: (..., in_features) in params_dtype. Returns (..., out_features), a Float8Tensor
        when fp8_output and FP8 are on, and with return_layernorm_output the pair (output, norm
        output (..., in_features)). is_first_microbatch: as for Linear.

        residual: optional, like inp: the layer normalizes h = inp + residual instead and returns
        (h, what it returns otherwise); under fp8_autocast the add runs inside the norm kernel
        (as LayerNormMLP's residual): the previous TransformerLayer's second residual add.

        rope: optional (cos, sin, heads, kv_heads) of a fused QKV projection (TransformerLayer
        under the kernel switch ROPE_CAST_BWD): where the GEMM runs in FP8 with a trainable
        weight, no fp8_output and no norm output, the output is the tuple (q, k, v) of
        RopeQKVParts, its backward casting from dq, dk, dv (modules/_qkv_rope.py); elsewhere the
        projection's output as without rope, which the caller rotates."""
        cfgs = self._fp8_forward_configs(
            inp, self.in_features, [("weight", self.weight)], is_first_microbatch,
            high_precision_input=True, fp8_output=self.fp8_output,
        )  # fmt: skip
        if fused_norm_linear(cfgs, self.return_layernorm_output):
            weight = self._wgrad_weight(self.weight)
            out, h = norm_linear(self, inp, residual, self.norm_spec, weight, self.bias, cfgs)
            ln_out = None
        elif hp_or_blockwise(cfgs):
            if plain_on():  # the norm kernels in bf16 (modules/_blockwise_plain.py)
                ln_out, h = plain_norm(self, inp, residual, self.norm_spec, apply_norm)
            else:
                h = inp if residual is None else inp + residual
                ln_out = apply_norm(self, h, self.norm_spec)
            weight = self._wgrad_weight(self.weight)
            out = linear(ln_out, weight, self.bias, cfgs)  # blockwise FP8 or high precision
        else:
            needs_t = torch.is_grad_enabled() and self.weight.requires_grad
            quantizer = partial(cfgs[0].quantizer, FwdRole.INPUT)
            x_fp8, ln_out, h = norm_fp8(
                self, inp, self.norm_spec, quantizer, needs_t=needs_t,
                hp_out=self.return_layernorm_output, residual=residual,
                observe=partial(cfgs[0].observe, FwdRole.INPUT),
            )  # fmt: skip
            if rope is not None and needs_t and not self.fp8_output and ln_out is None:
                out = fp8_linear_rope(x_fp8, self.weight, self.bias, cfgs[0], rope[:2], *rope[2:])
            else:
                out = fp8_linear(x_fp8, self.weight, self.bias, cfgs[0])
        result = (out, ln_out) if self.return_layernorm_output else out
        return result if residual is None else (h, result)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"normalization={self.normalization}, fp8_output={self.fp8_output}"
        )
