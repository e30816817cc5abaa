"""graphfp8.convert: swap torch.nn layers of a model for graphfp8 layers, keeping the weights.

Limits: a LayerNorm is fused with the Linear that follows it only where both sit next to each
other in an nn.Sequential (that is the only place where the data flow is visible without
tracing); the LayerNorm's slot then holds an nn.Identity so indices stay the same. Every other
nn.Linear becomes a graphfp8.Linear. Layers whose dims are not multiples of 16 are converted too
and raise a clear error when run under fp8_autocast.

The new layers hold the old layers' Parameter objects themselves (not copies): weights tied to
other modules (an embedding and its output head) stay tied, and an optimizer built before the
conversion still updates the model. A module reached twice (shared) becomes one new module.
"""

from __future__ import annotations

from torch import nn

from graphfp8.fp8.primary import INIT
from graphfp8.modules.layernorm_linear import LayerNormLinear
from graphfp8.modules.linear import Linear

__all__ = ["convert"]


def _linear(old: nn.Linear) -> Linear:
    # Built on the meta device (no allocation, no initialisation), then given the old Parameters.
    new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                 params_dtype=old.weight.dtype, device="meta")  # fmt: skip
    new.weight, new.bias = old.weight, old.bias
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
                          device="meta")  # fmt: skip
    new.layer_norm_weight, new.layer_norm_bias = norm.weight, norm.bias
    new.weight, new.bias = old.weight, old.bias
    return new


def _convert_children(module: nn.Module, fuse_layernorm: bool, done: dict) -> None:
    """Converts module's children in place; `done` maps id(old module) -> its replacement, so
    that a module shared by several parents is converted once."""
    names = list(module._modules)
    i = 0
    while i < len(names):
        name, child = names[i], module._modules[names[i]]
        after = module._modules[names[i + 1]] if i + 1 < len(names) else None
        if id(child) in done:
            module._modules[name] = done[id(child)]
        elif (fuse_layernorm and isinstance(module, nn.Sequential) and _fusable(child, after)
              and id(after) not in done):  # fmt: skip
            fused = _layernorm_linear(child, after)
            done[id(after)] = fused
            module._modules[name] = nn.Identity()
            module._modules[names[i + 1]] = fused
            i += 2
            continue
        elif isinstance(child, nn.Linear):
            done[id(child)] = module._modules[name] = _linear(child)
        elif child is not None:
            done[id(child)] = child
            _convert_children(child, fuse_layernorm, done)
        i += 1


def convert(model: nn.Module, fuse_layernorm: bool = True) -> nn.Module:
    """Replaces nn.Linear (and LayerNorm + Linear pairs of an nn.Sequential) by graphfp8 layers
    in place; the new layers hold the same Parameter objects, so tied weights stay tied. Returns
    the model (a new module if `model` itself is an nn.Linear)."""
    if INIT.enabled:
        raise RuntimeError(
            "graphfp8.convert keeps the model's own (high-precision) Parameters, so it cannot "
            "make FP8 primary weights: build the model from graphfp8 layers inside "
            "fp8_model_init and load_state_dict the high-precision weights (they are quantized)"
        )
    if isinstance(model, nn.Linear):
        return _linear(model)
    _convert_children(model, fuse_layernorm, {id(model): model})
    return model
