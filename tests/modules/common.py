"""Builders shared by the module and graph tests: graphfp8 layers, torch.nn twins with the same
weights, and a stack that mixes graphfp8 layers with plain torch layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from graphfp8.modules._state_tensor import decode
from graphfp8.modules.layernorm_mlp import ACTIVATIONS

H = 32  # hidden size: a multiple of 16
T = 48  # tokens per microbatch: a multiple of 16


class Stack(nn.Module):
    """LayerNormLinear -> GELU (torch) -> Linear -> LayerNorm (torch) -> LayerNormMLP."""

    def __init__(self, hidden=H, dtype=torch.bfloat16, device="cpu", fp8_output=False):
        super().__init__()
        kw = dict(params_dtype=dtype, device=device)
        self.qkv = g8.LayerNormLinear(hidden, 2 * hidden, fp8_output=fp8_output, **kw)
        self.act = nn.GELU()
        self.proj = g8.Linear(2 * hidden, hidden, **kw)
        self.norm = nn.LayerNorm(hidden, dtype=dtype, device=device)
        self.mlp = g8.LayerNormMLP(hidden, 2 * hidden, **kw)
        self.fp8_output = fp8_output

    def forward(self, x, is_first_microbatch=None):
        h = self.qkv(x, is_first_microbatch=is_first_microbatch)
        if not self.fp8_output:
            h = self.act(h)
        h = self.proj(h, is_first_microbatch=is_first_microbatch)
        return self.mlp(self.norm(h), is_first_microbatch=is_first_microbatch)


def build(kind: str, dtype=torch.bfloat16, device="cpu") -> nn.Module:
    kw = dict(params_dtype=dtype, device=device)
    if kind == "Linear":
        return g8.Linear(H, 2 * H, **kw)
    if kind == "LayerNormLinear":
        return g8.LayerNormLinear(H, 2 * H, **kw)
    if kind == "RMSNormLinear":
        return g8.LayerNormLinear(H, 2 * H, normalization="RMSNorm", **kw)
    if kind == "LayerNormMLP":
        return g8.LayerNormMLP(H, 4 * H, **kw)
    if kind == "RMSNormMLP":  # zero-centered gamma, randomised so that it matters
        m = g8.LayerNormMLP(H, 4 * H, normalization="RMSNorm", zero_centered_gamma=True, **kw)
        with torch.no_grad():
            m.layer_norm_weight.normal_(0.0, 0.2)
        return m
    if kind == "SwiGLUMLP":  # Llama's MLP: RMSNorm, SwiGLU, no biases
        return g8.LayerNormMLP(H, 2 * H, normalization="RMSNorm", bias=False,
                               activation="swiglu", **kw)  # fmt: skip
    if kind == "GeGLUMLP":  # with biases: the fused dbias of both halves
        return g8.LayerNormMLP(H, 2 * H, activation="geglu", **kw)
    if kind == "Stack":
        return Stack(dtype=dtype, device=device)
    if kind == "Chain":
        return Stack(dtype=dtype, device=device, fp8_output=True)
    if kind == "TransformerLayer":
        return g8.TransformerLayer(H, 2, 2 * H, max_seq_len=T, **kw)
    if kind == "LlamaLayer":  # RMSNorm, grouped-query attention (1 kv head for 2), SwiGLU, no bias
        return g8.TransformerLayer(H, 2, 2 * H, max_seq_len=T, num_gqa_groups=1,
                                   normalization="RMSNorm", bias=False, activation="swiglu",
                                   **kw)  # fmt: skip
    if kind == "RMSNormTransformerLayer":
        return g8.TransformerLayer(H, 2, 2 * H, max_seq_len=T, normalization="RMSNorm",
                                   zero_centered_gamma=True, **kw)  # fmt: skip
    raise ValueError(kind)


def torch_twin(m: nn.Module):
    """The same math with torch.nn functional ops, on m's own parameters (high precision)."""
    if isinstance(m, g8.Linear):
        return lambda x: F.linear(x, m.weight, m.bias)
    if isinstance(m, g8.LayerNormLinear):
        return lambda x: F.linear(_torch_norm(m, x), m.weight, m.bias)
    if isinstance(m, g8.LayerNormMLP):

        def f(x):
            y = ACTIVATIONS[m.activation](F.linear(_torch_norm(m, x), m.fc1_weight, m.fc1_bias))
            return F.linear(y, m.fc2_weight, m.fc2_bias)

        return f
    if isinstance(m, g8.TransformerLayer):

        def f(x):
            h = x + torch_twin(m.proj)(m.attention(torch_twin(m.qkv)(x)))
            return h + torch_twin(m.mlp)(h)

        return f
    raise ValueError(type(m))


def _torch_norm(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """m's LayerNorm / RMSNorm as torch.nn.functional ops (weight 1 + gamma when zero-centered)."""
    weight = m.layer_norm_weight + 1 if m.zero_centered_gamma else m.layer_norm_weight
    if m.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, m.layer_norm_bias, m.eps)
    return F.rms_norm(x, (x.shape[-1],), weight, m.eps)


def input_shape(m: nn.Module, tokens: int = T) -> tuple[int, ...]:
    """A (tokens, features) input, or (2, tokens / 2, H) for a TransformerLayer."""
    if isinstance(m, g8.TransformerLayer):
        return (2, tokens // 2, m.hidden_size)
    return (tokens, in_features(m))


def in_features(m: nn.Module) -> int:
    if isinstance(m, (g8.LayerNormMLP, g8.TransformerLayer)):
        return m.hidden_size
    return getattr(m, "in_features", H)


def fp8_state(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every FP8 history and scale of m's graphfp8 layers, named."""
    out = []
    for name, mod in m.named_modules():
        meta = getattr(mod, "fp8_meta", None)
        if meta is not None:
            out += [
                (f"{name}.fwd_history", meta.fwd.history()),
                (f"{name}.fwd_scale", meta.fwd.scales()),
                (f"{name}.bwd_history", meta.bwd.history()),
                (f"{name}.bwd_scale", meta.bwd.scales()),
            ]
    return out


def extra_state(state: torch.Tensor) -> dict:
    """The dict form of a module's `_extra_state` tensor (its recipe as a recipe object)."""
    return decode(state, "test")


def train_once(layer, x, dy, recipe):
    """One forward and backward under fp8_autocast(recipe): (y, x.grad, the layer's grads by
    name); the layer's grads are set to None afterwards."""
    x = x.clone().requires_grad_()
    with g8.fp8_autocast(recipe=recipe):
        y = layer(x)
    y.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads
