"""graphfp8.convert: swap torch.nn layers of a model for graphfp8 layers, keeping the weights.

Limits: a LayerNorm is fused with the Linear that follows it only where both sit next to each
other in an nn.Sequential (that is the only place where the data flow is visible without
tracing); the LayerNorm's slot then holds an nn.Identity so indices stay the same. Every other
nn.Linear becomes a graphfp8.Linear. Layers whose dims are not multiples of 16 are converted too
and raise a clear error when run under fp8_autocast.
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.modules.layernorm_linear import LayerNormLinear
from graphfp8.modules.linear import Linear

__all__ = ["convert"]


def _linear(old: nn.Linear) -> Linear:
    new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                 params_dtype=old.weight.dtype, device=old.weight.device)  # fmt: skip
    with torch.no_grad():
        new.weight.copy_(old.weight)
        if old.bias is not None:
            new.bias.copy_(old.bias)
    return new


def _fusable(norm: nn.Module, lin: nn.Module) -> bool:
    return (
        isinstance(norm, nn.LayerNorm)
        and isinstance(lin, nn.Linear)
        and norm.elementwise_affine
        and norm.bias is not None
        and tuple(norm.normalized_shape) == (lin.in_features,)
        and norm.weight.dtype == lin.weight.dtype
    )


def _layernorm_linear(norm: nn.LayerNorm, old: nn.Linear) -> LayerNormLinear:
    new = LayerNormLinear(old.in_features, old.out_features, eps=norm.eps,
                          bias=old.bias is not None, params_dtype=old.weight.dtype,
                          device=old.weight.device)  # fmt: skip
    with torch.no_grad():
        new.layer_norm_weight.copy_(norm.weight)
        new.layer_norm_bias.copy_(norm.bias)
        new.weight.copy_(old.weight)
        if old.bias is not None:
            new.bias.copy_(old.bias)
    return new


def _convert_children(module: nn.Module, fuse_layernorm: bool) -> None:
    names = list(module._modules)
    i = 0
    while i < len(names):
        name, child = names[i], module._modules[names[i]]
        after = module._modules[names[i + 1]] if i + 1 < len(names) else None
        if fuse_layernorm and isinstance(module, nn.Sequential) and _fusable(child, after):
            module._modules[name] = nn.Identity()
            module._modules[names[i + 1]] = _layernorm_linear(child, after)
            i += 2
            continue
        if isinstance(child, nn.Linear):
            module._modules[name] = _linear(child)
        elif child is not None:
            _convert_children(child, fuse_layernorm)
        i += 1


def convert(model: nn.Module, fuse_layernorm: bool = True) -> nn.Module:
    """Replaces nn.Linear (and LayerNorm + Linear pairs of an nn.Sequential) by graphfp8 layers
    in place, copying their parameters. Returns the model (a new module if `model` itself is an
    nn.Linear)."""
    if isinstance(model, nn.Linear):
        return _linear(model)
    _convert_children(model, fuse_layernorm)
    return model
