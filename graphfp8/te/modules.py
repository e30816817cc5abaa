"""graphfp8.te's GEMM layers and norms: TransformerEngine's constructors and forward arguments
over graphfp8's Linear, LayerNormLinear and LayerNormMLP (the same modules, with TE's defaults:
N(0, 0.023) weights, zero biases, the CUDA device when there is one) and torch's norms.

Each class is a subclass of the graphfp8 layer, so graphs, checkpoints, fp8_model_init and
MasterWeights treat it as that layer; parameter names are TE's (weight, bias, layer_norm_weight,
layer_norm_bias, fc1_weight, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphfp8 import modules
from graphfp8.te._args import PARALLEL, UB, check_te_args, default_device, default_init

__all__ = ["LayerNorm", "LayerNormLinear", "LayerNormMLP", "Linear", "RMSNorm"]

_LINEAR_TE_ONLY = {
    **PARALLEL,
    **UB,
    "rng_tracker_name": None,
    "return_bias": False,
    "parallel_mode": None,
    "parameters_split": None,
    "save_original_input": False,
}
_LNLINEAR_TE_ONLY = {
    **PARALLEL,
    **UB,
    "return_bias": False,
    "parallel_mode": None,
    "return_layernorm_output_gathered": False,
    "parameters_split": None,
}
_MLP_TE_ONLY = {
    **PARALLEL,
    **UB,
    "return_bias": False,
    "activation_params": None,
    "return_layernorm_output": False,
    "return_layernorm_output_gathered": False,
    "seq_length": None,
    "micro_batch_size": None,
    "set_parallel_mode": False,
    "checkpoint": False,
}
# forward(inp, is_first_microbatch, fp8_output, fp8_grad): FP8 hand-offs chosen per call.
_FORWARD_TE_ONLY = {"fp8_output": False, "fp8_grad": False}


class Linear(modules.Linear):
    """TE's Linear(in_features, out_features, ...): graphfp8.Linear. Supported: init_method,
    bias, params_dtype, device, name; TE's other arguments only at their defaults."""

    def __init__(self, in_features: int, out_features: int, *, init_method=None,
                 bias: bool = True, params_dtype: torch.dtype | None = None, device=None,
                 name: str | None = None, **te_only):  # fmt: skip
        check_te_args("Linear", te_only, _LINEAR_TE_ONLY)
        super().__init__(in_features, out_features, bias=bias, params_dtype=params_dtype,
                         device=default_device(device),
                         init_method=default_init(init_method))  # fmt: skip
        self.name = name

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, **te_only):
        """inp: (..., in_features). Returns (..., out_features); see graphfp8.Linear."""
        check_te_args("Linear.forward", te_only, _FORWARD_TE_ONLY)
        return super().forward(inp, is_first_microbatch)


class LayerNormLinear(modules.LayerNormLinear):
    """TE's LayerNormLinear(in_features, out_features, eps, ...): graphfp8.LayerNormLinear.
    Supported: eps, init_method, bias, normalization, params_dtype, return_layernorm_output,
    zero_centered_gamma, device, name; TE's other arguments only at their defaults."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *,
                 init_method=None, bias: bool = True, normalization: str = "LayerNorm",
                 params_dtype: torch.dtype | None = None, return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, device=None, name: str | None = None,
                 **te_only):  # fmt: skip
        check_te_args("LayerNormLinear", te_only, _LNLINEAR_TE_ONLY)
        super().__init__(in_features, out_features, eps=eps, bias=bias,
                         normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                         return_layernorm_output=return_layernorm_output,
                         params_dtype=params_dtype, device=default_device(device),
                         init_method=default_init(init_method))  # fmt: skip
        self.name = name

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, **te_only):
        """inp: (..., in_features). Returns (..., out_features) (and the norm's output with
        return_layernorm_output); see graphfp8.LayerNormLinear."""
        check_te_args("LayerNormLinear.forward", te_only, _FORWARD_TE_ONLY)
        return super().forward(inp, is_first_microbatch)


class LayerNormMLP(modules.LayerNormMLP):
    """TE's LayerNormMLP(hidden_size, ffn_hidden_size, eps, ...): graphfp8.LayerNormMLP.
    Supported: eps, init_method, bias, normalization, activation ("gelu", "relu", "swiglu",
    "geglu"; TE's others raise), output_layer_init_method, params_dtype, zero_centered_gamma,
    device, name; TE's other arguments only at their defaults."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, *,
                 init_method=None, bias: bool = True, normalization: str = "LayerNorm",
                 activation: str = "gelu", output_layer_init_method=None,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 device=None, name: str | None = None, **te_only):  # fmt: skip
        check_te_args("LayerNormMLP", te_only, _MLP_TE_ONLY)
        init, out_init = default_init(init_method), default_init(output_layer_init_method)
        super().__init__(hidden_size, ffn_hidden_size, eps=eps, bias=bias, activation=activation,
                         normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                         params_dtype=params_dtype, device=default_device(device),
                         init_method=init, output_layer_init_method=out_init)  # fmt: skip
        self.name = name

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                residual: torch.Tensor | None = None):  # fmt: skip
        """inp: (..., hidden_size). Returns (..., hidden_size); residual (not a TE argument:
        graphfp8.te.TransformerLayer's first residual add) as for graphfp8.LayerNormMLP."""
        return super().forward(inp, is_first_microbatch, residual)


class _Norm(nn.Module):
    """TE's LayerNorm / RMSNorm: torch's norm over the last dimensions, TE's arguments."""

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel=None,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 hidden_size: int | None = None, *, device=None, dtype=None,
                 sm_margin=0):  # fmt: skip
        super().__init__()
        where = type(self).__name__
        check_te_args(where, {"sm_margin": sm_margin}, {"sm_margin": 0})
        if (normalized_shape is None) == (hidden_size is None):
            raise TypeError(f"graphfp8.te.{where}: give normalized_shape (or hidden_size)")
        if params_dtype is not None and dtype is not None:
            raise TypeError(f"graphfp8.te.{where}: give dtype or params_dtype, not both")
        shape = normalized_shape if hidden_size is None else hidden_size
        self.normalized_shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.sequence_parallel = sequence_parallel  # a flag for Megatron-LM, as in TE
        kw = dict(dtype=dtype or params_dtype, device=default_device(device))
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = nn.Parameter(init(self.normalized_shape, **kw))

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class LayerNorm(_Norm):
    """TE's LayerNorm: y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta over the last dims
    (gamma = 1 + weight with zero_centered_gamma). Parameters weight and bias."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bias = nn.Parameter(torch.zeros_like(self.weight))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """inp: (..., *normalized_shape). Returns the same shape and dtype."""
        return F.layer_norm(inp, self.normalized_shape, self.gamma(), self.bias, self.eps)


class RMSNorm(_Norm):
    """TE's RMSNorm: y = x / sqrt(mean(x^2) + eps) * gamma over the last dims. Parameter
    weight."""

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """inp: (..., *normalized_shape). Returns the same shape and dtype."""
        return F.rms_norm(inp, self.normalized_shape, self.gamma(), self.eps)
