"""graphfp8.te's GEMM layers and norms: TransformerEngine's constructors and forward arguments
over graphfp8's Linear, LayerNormLinear and LayerNormMLP (the same modules, with TE's defaults:
N(0, 0.023) weights, zero biases, the CUDA device when there is one) and torch's norms.

Each class is a subclass of the graphfp8 layer, so graphs, checkpoints, fp8_model_init and
MasterWeights treat it as that layer; parameter names are TE's (weight, bias, layer_norm_weight,
layer_norm_bias, fc1_weight, ...).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from graphfp8 import modules
from graphfp8.fp8.tensor import Float8Tensor
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
_NARROW = (torch.bfloat16, torch.float16)


def _input_dtype(inp, param: torch.Tensor):
    """TE computes in its input's dtype: a bf16/fp16 input on float32 parameters casts the
    weights (TE's cast_if_needed). graphfp8's layers do that under torch.autocast of the input's
    dtype (modules/_autocast.py: the same FP8 GEMMs, the output in that dtype), so such a call
    runs inside one; any other call (or one already under torch.autocast) is left as it is."""
    kind = inp.device.type if isinstance(inp, torch.Tensor) else None
    if (
        kind in ("cpu", "cuda")
        and type(inp) is torch.Tensor
        and inp.dtype in _NARROW
        and param.dtype == torch.float32
        and not torch.is_autocast_enabled(kind)
    ):
        return torch.autocast(kind, dtype=inp.dtype)
    return contextlib.nullcontext()


class Linear(modules.Linear):
    """TE's Linear(in_features, out_features, ...): graphfp8.Linear. Supported: init_method,
    bias, params_dtype, device, fuse_wgrad_accumulation, name; TE's other arguments only at
    their defaults."""

    def __init__(self, in_features: int, out_features: int, *, init_method=None,
                 bias: bool = True, params_dtype: torch.dtype | None = None, device=None,
                 fuse_wgrad_accumulation: bool = False, name: str | None = None,
                 **te_only):  # fmt: skip
        check_te_args("Linear", te_only, _LINEAR_TE_ONLY)
        self._init_method = default_init(init_method)
        super().__init__(in_features, out_features, bias=bias, params_dtype=params_dtype,
                         device=default_device(device), init_method=self._init_method,
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation)  # fmt: skip
        self.name = name

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, **te_only):
        """inp: (..., in_features), in the parameters' dtype or (float32 parameters) bf16/fp16,
        TE's activation dtype. Returns (..., out_features) in inp's dtype; see graphfp8.Linear."""
        check_te_args("Linear.forward", te_only, _FORWARD_TE_ONLY)
        with _input_dtype(inp, self.weight):
            return super().forward(inp, is_first_microbatch)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """TE's: the weight from init_method again, the bias 0 (nothing with defer_init)."""
        if defer_init:
            return
        if isinstance(self.weight, Float8Tensor):
            raise NotImplementedError(
                "graphfp8.te.Linear.reset_parameters: the weight is an FP8 primary weight "
                "(fp8_model_init); build the layer again inside fp8_model_init"
            )
        with torch.no_grad():
            self._init_method(self.weight)
            if self.bias is not None:
                self.bias.zero_()
        self.weight_cache.invalidate()


class LayerNormLinear(modules.LayerNormLinear):
    """TE's LayerNormLinear(in_features, out_features, eps, ...): graphfp8.LayerNormLinear.
    Supported: eps, init_method, bias, normalization, params_dtype, return_layernorm_output,
    zero_centered_gamma, device, fuse_wgrad_accumulation, name; TE's other arguments only at
    their defaults."""

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, *,
                 init_method=None, bias: bool = True, normalization: str = "LayerNorm",
                 params_dtype: torch.dtype | None = None, return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, device=None,
                 fuse_wgrad_accumulation: bool = False, name: str | None = None,
                 **te_only):  # fmt: skip
        check_te_args("LayerNormLinear", te_only, _LNLINEAR_TE_ONLY)
        super().__init__(in_features, out_features, eps=eps, bias=bias,
                         normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                         return_layernorm_output=return_layernorm_output,
                         params_dtype=params_dtype, device=default_device(device),
                         init_method=default_init(init_method),
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation)  # fmt: skip
        self.name = name

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, **te_only):
        """inp: (..., in_features). Returns (..., out_features) (and the norm's output with
        return_layernorm_output); see graphfp8.LayerNormLinear."""
        check_te_args("LayerNormLinear.forward", te_only, _FORWARD_TE_ONLY)
        with _input_dtype(inp, self.weight):
            return super().forward(inp, is_first_microbatch)


class LayerNormMLP(modules.LayerNormMLP):
    """TE's LayerNormMLP(hidden_size, ffn_hidden_size, eps, ...): graphfp8.LayerNormMLP.
    Supported: eps, init_method, bias, normalization, activation ("gelu", "relu", "swiglu",
    "geglu"; TE's others raise), output_layer_init_method, params_dtype, zero_centered_gamma,
    device, fuse_wgrad_accumulation, name; TE's other arguments only at their defaults."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, *,
                 init_method=None, bias: bool = True, normalization: str = "LayerNorm",
                 activation: str = "gelu", output_layer_init_method=None,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 device=None, fuse_wgrad_accumulation: bool = False, name: str | None = None,
                 **te_only):  # fmt: skip
        check_te_args("LayerNormMLP", te_only, _MLP_TE_ONLY)
        init, out_init = default_init(init_method), default_init(output_layer_init_method)
        super().__init__(hidden_size, ffn_hidden_size, eps=eps, bias=bias, activation=activation,
                         normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                         params_dtype=params_dtype, device=default_device(device),
                         init_method=init, output_layer_init_method=out_init,
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation)  # fmt: skip
        self.name = name

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None,
                residual: torch.Tensor | None = None):  # fmt: skip
        """inp: (..., hidden_size). Returns (..., hidden_size); residual (not a TE argument:
        graphfp8.te.TransformerLayer's first residual add) as for graphfp8.LayerNormMLP."""
        with _input_dtype(inp, self.fc1_weight):
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
