"""graphfp8.LayerNormMLP: Norm -> FP8 fc1 -> activation -> FP8 fc2; under fp8_autocast the norm
writes fc1's FP8 input directly (graphfp8.modules._norm)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from graphfp8.fp8.slots import FwdRole
from graphfp8.modules._blockwise import hp_or_blockwise, linear
from graphfp8.modules._blockwise_act import act_linear, fused_act_linear
from graphfp8.modules._blockwise_norm import fused_norm_linear, norm_linear
from graphfp8.modules._blockwise_plain import plain_act, plain_norm, plain_on
from graphfp8.modules._functional import GemmConfig, fp8_linear
from graphfp8.modules._mlp import FUSED_ACTIVATIONS, fp8_mlp
from graphfp8.modules._norm import NormSpec, apply_norm, make_norm_params, norm_fp8
from graphfp8.modules.base import FP8Module
from graphfp8.modules.linear import InitMethod, linear_params

__all__ = ["LayerNormMLP"]


def _gated(act):
    """The gated activation act(g) * u of h = [g | u] (the gate first, TransformerEngine's and
    Hugging Face's order; PyTorch's F.glu gates the second half)."""

    def f(h: torch.Tensor) -> torch.Tensor:
        g, u = h.chunk(2, dim=-1)
        return act(g) * u

    return f


ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),  # TransformerEngine's "gelu"
    "relu": F.relu,
    "swiglu": _gated(F.silu),
    "geglu": _gated(lambda g: F.gelu(g, approximate="tanh")),
}
GATED = ("swiglu", "geglu")


class LayerNormMLP(FP8Module):
    """y = fc2(act(fc1(Norm(x)))), both GEMMs in FP8 under fp8_autocast.

    Args:
        hidden_size: H, a multiple of 16 for FP8.
        ffn_hidden_size: F, a multiple of 16 for FP8.
        eps: normalization epsilon.
        bias: learn fc1/fc2 biases.
        activation: "gelu" (tanh approximation, as TransformerEngine), "relu", or the gated
            "swiglu" (silu(g) * u) and "geglu" (gelu(g) * u), for which fc1 has 2 F outputs,
            the gate g first (TransformerEngine's layout; Hugging Face's gate_proj then up_proj).
        normalization: "LayerNorm" or "RMSNorm".
        zero_centered_gamma: the norm's weight is 1 + layer_norm_weight, which starts at 0.
        params_dtype, device, fuse_wgrad_accumulation: as for Linear (both weights).
        init_method: initialises fc1's weight (biases then start at 0), as for Linear.
        output_layer_init_method: fc2's (default: init_method), TransformerEngine's name.
    """

    num_gemms = 2
    gemm_names = ("fc1", "fc2")  # the numerics report's GEMM names
    # Selective recompute (TransformerLayer(recompute="selective")): the fused FP8 activation's
    # output is cast again in the backward instead of kept (modules/_mlp.py; same bits).
    recompute_activation = False

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5,
                 bias: bool = True, activation: str = "gelu", normalization: str = "LayerNorm",
                 zero_centered_gamma: bool = False, params_dtype: torch.dtype | None = None,
                 device=None, init_method: InitMethod | None = None,
                 output_layer_init_method: InitMethod | None = None,
                 fuse_wgrad_accumulation: bool = False):  # fmt: skip
        super().__init__()
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"LayerNormMLP: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
            )
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.normalization, self.activation = eps, normalization, activation
        self.zero_centered_gamma = zero_centered_gamma
        make_norm_params(self, hidden_size, normalization, dtype, device, zero_centered_gamma)
        fc1_out = 2 * ffn_hidden_size if activation in GATED else ffn_hidden_size
        self.fc1_weight, self.fc1_bias = linear_params(hidden_size, fc1_out, bias, dtype, device,
                                                       init_method)  # fmt: skip
        self.fc2_weight, self.fc2_bias = linear_params(
            ffn_hidden_size, hidden_size, bias, dtype, device,
            output_layer_init_method or init_method,
        )  # fmt: skip

    @property
    def norm_spec(self) -> NormSpec:
        return NormSpec(self.normalization, self.eps, self.zero_centered_gamma)

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                residual: torch.Tensor | None = None):  # fmt: skip
        """inp: (..., hidden_size) in params_dtype. Returns (..., hidden_size).
        is_first_microbatch: as for Linear (both weights).

        residual: optional, like inp: the layer normalizes h = inp + residual instead and returns
        (h, output). Under fp8_autocast the add runs inside the norm kernel (and its backward's
        gradient sum inside the norm's backward): TransformerLayer's first residual add. It is
        an argument of forward, not a separate method, so that torch.compile keeps the whole FP8
        call opaque (graphfp8.modules._compile).
        """
        weights = [("fc1", self.fc1_weight), ("fc2", self.fc2_weight)]
        cfgs = self._fp8_forward_configs(inp, self.hidden_size, weights, is_first_microbatch,
                                         high_precision_input=True)  # fmt: skip
        if hp_or_blockwise(cfgs):
            act = ACTIVATIONS[self.activation]
            # Blockwise FP8 GEMMs under Float8BlockScaling (modules/_blockwise.py).
            w1, w2 = self._wgrad_weight(self.fc1_weight), self._wgrad_weight(self.fc2_weight)
            if fused_norm_linear(cfgs, False):  # the norm writes fc1's tiles (_blockwise_norm)
                fc1, h = norm_linear(self, inp, residual, self.norm_spec, w1, self.fc1_bias,
                                     cfgs)  # fmt: skip
            else:
                if plain_on():  # the norm kernels in bf16 (modules/_blockwise_plain.py)
                    ln_out, h = plain_norm(self, inp, residual, self.norm_spec, apply_norm)
                else:
                    h = inp if residual is None else inp + residual
                    ln_out = apply_norm(self, h, self.norm_spec)
                fc1 = linear(ln_out, w1, self.fc1_bias, cfgs, 0)
            if fused_act_linear(cfgs, self.activation):  # the activation writes fc2's tiles
                out = act_linear(fc1, self.activation, w2, self.fc2_bias, cfgs)
            else:
                a = plain_act(fc1, self.activation, act) if plain_on() else act(fc1)
                out = linear(a, w2, self.fc2_bias, cfgs, 1)
        else:
            needs_t = torch.is_grad_enabled() and self.fc1_weight.requires_grad
            quantizer = partial(cfgs[0].quantizer, FwdRole.INPUT)
            x_fp8, _, h = norm_fp8(self, inp, self.norm_spec, quantizer, needs_t=needs_t,
                                   residual=residual,
                                   observe=partial(cfgs[0].observe, FwdRole.INPUT))  # fmt: skip
            out = self._mlp_fp8(x_fp8, cfgs)
        return out if residual is None else (h, out)

    def _mlp_fp8(self, x_fp8, cfgs: list[GemmConfig]) -> torch.Tensor:
        """fc2(act(fc1(x))) in FP8 for the normalized input x_fp8 (a Float8Tensor (...,
        hidden_size) from this module's norm, in cfgs[0]'s INPUT slot)."""
        cfg1, cfg2 = cfgs
        if self.activation in FUSED_ACTIVATIONS:
            # The activation and its backward fused into the FP8 casts around it (modules/_mlp).
            return fp8_mlp(x_fp8, self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias,
                           cfg1, cfg2, self.activation, self.recompute_activation)  # fmt: skip
        hidden = ACTIVATIONS[self.activation](fp8_linear(x_fp8, self.fc1_weight, self.fc1_bias,
                                                         cfg1))  # fmt: skip
        return fp8_linear(hidden, self.fc2_weight, self.fc2_bias, cfg2)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, normalization={self.normalization}"
        )
