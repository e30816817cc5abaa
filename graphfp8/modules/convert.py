"""graphfp8.convert: swap torch.nn layers of a model for graphfp8 layers, keeping the weights.

Limits: a LayerNorm is fused with the Linear that follows it only where both sit next to each
other in an nn.Sequential (that is the only place where the data flow is visible without
tracing), and only a plain nn.LayerNorm without hooks; the LayerNorm's slot then holds an
nn.Identity so indices stay the same. Every other nn.Linear becomes a graphfp8.Linear.

What a graphfp8.Linear cannot keep is refused, naming each module, before anything changes (the
model is converted whole or not at all): an nn.Linear subclass with its own forward or with more
state than weight and bias, forward/backward/state-dict hooks, parametrizations (weight_norm,
spectral_norm), an uninitialised LazyLinear, parameters FP8 cannot run (in/out features not
multiples of 16, a dtype other than float32/bfloat16/float16). `module_filter` leaves such
layers (or any others) as they are.

The new layers hold the old layers' Parameter objects themselves (not copies): weights tied to
other modules (an embedding and its output head) stay tied, and an optimizer built before the
conversion still updates the model. A module reached twice (shared) becomes one new module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.utils import parametrize

from graphfp8.fp8.primary import INIT
from graphfp8.fp8.recipe import Recipe
from graphfp8.modules.base import FP8_PARAM_DTYPES, fp8_entries_hook
from graphfp8.modules.carry import FP8Carry, carry
from graphfp8.modules.layernorm_linear import LayerNormLinear
from graphfp8.modules.linear import Linear

__all__ = ["convert"]

ModuleFilter = Callable[[nn.Module, str], bool]

# Hooks that a replaced module would take with it: what they do would silently stop.
_HOOKS = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
    "_state_dict_pre_hooks": "state_dict pre-hooks",
    "_state_dict_hooks": "state_dict hooks",
    "_load_state_dict_pre_hooks": "load_state_dict pre-hooks",
    "_load_state_dict_post_hooks": "load_state_dict post-hooks",
}


def _hooks(m: nn.Module) -> list[str]:
    return [what for attr, what in _HOOKS.items() if getattr(m, attr, None)]


def _refusal(lin: nn.Linear) -> str | None:
    """Why `lin` cannot become a graphfp8.Linear without changing what it computes or holds."""
    if isinstance(lin, LazyModuleMixin) and lin.has_uninitialized_params():
        return "is an uninitialised LazyLinear: run one forward (or build an nn.Linear) first"
    if parametrize.is_parametrized(lin):
        names = sorted(lin.parametrizations.keys())
        return (f"has parametrizations of {names} (weight_norm, spectral_norm, ...), which "
                "graphfp8 layers do not run: torch.nn.utils.parametrize.remove_parametrizations"
                " first")  # fmt: skip
    if type(lin).forward is not nn.Linear.forward:
        return f"is a {type(lin).__name__} with its own forward, which a graphfp8.Linear drops"
    hooks = _hooks(lin)
    if hooks:
        return (f"has {', '.join(hooks)}, which a graphfp8.Linear would not run: remove them and "
                "register them on the converted layer")  # fmt: skip
    extra = [n for n in (*lin._parameters, *lin._buffers) if n not in ("weight", "bias")]
    extra += list(lin._modules)
    if extra:
        return f"holds {extra} besides weight and bias, which a graphfp8.Linear drops"
    if not isinstance(lin._parameters.get("weight"), nn.Parameter):
        return f"has a weight of type {type(lin.weight).__name__}, not an nn.Parameter"
    if lin.weight.dtype not in FP8_PARAM_DTYPES:
        return f"has {lin.weight.dtype} parameters: FP8 needs float32, bfloat16 or float16"
    if lin.in_features % 16 or lin.out_features % 16:
        return ("cannot run in FP8: FP8 GEMMs need in_features and out_features to be multiples "
                "of 16")  # fmt: skip
    return None


def _linear(old: nn.Linear) -> Linear:
    # Built on the meta device (no allocation, no initialisation), then given the old Parameters.
    new = Linear(old.in_features, old.out_features, bias=old.bias is not None,
                 params_dtype=old.weight.dtype, device="meta")  # fmt: skip
    new.weight, new.bias = old.weight, old.bias
    return new


def _fusable(norm: nn.Module, lin: nn.Module) -> bool:
    return (
        type(norm) is nn.LayerNorm
        and not _hooks(norm)
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


@dataclass
class _Plan:
    """What convert will do, found without touching the model: (parent, key, new module) edits,
    and the refusals (one line each) that stop it."""

    fuse_layernorm: bool
    module_filter: ModuleFilter | None
    done: dict = field(default_factory=dict)  # id(old module) -> its replacement (or itself)
    edits: list = field(default_factory=list)
    refusals: list = field(default_factory=list)

    def wanted(self, lin: nn.Module, path: str) -> bool:
        """Whether the nn.Linear at `path` is to be converted; notes why it cannot be."""
        if not isinstance(lin, nn.Linear):
            return False
        if self.module_filter is not None and not self.module_filter(lin, path):
            return False
        reason = _refusal(lin)
        if reason is not None:
            self.refusals.append(f"{path or 'the model'} ({_describe(lin)}) {reason}")
            self.done[id(lin)] = lin  # reported once, however often it is reached
            return False
        return True


def _describe(lin: nn.Linear) -> str:
    return f"{type(lin).__name__}({lin.in_features}, {lin.out_features})"


def _plan_children(module: nn.Module, prefix: str, plan: _Plan) -> None:
    names = list(module._modules)
    i = 0
    while i < len(names):
        name, child = names[i], module._modules[names[i]]
        path = prefix + name
        after = module._modules[names[i + 1]] if i + 1 < len(names) else None
        if child is None:
            pass
        elif id(child) in plan.done:
            plan.edits.append((module, name, plan.done[id(child)]))
        elif (plan.fuse_layernorm and isinstance(module, nn.Sequential)
              and _fusable(child, after) and id(after) not in plan.done
              and plan.wanted(after, prefix + names[i + 1])):  # fmt: skip
            fused = _layernorm_linear(child, after)
            plan.done[id(child)], plan.done[id(after)] = child, fused
            plan.edits += [(module, name, nn.Identity()), (module, names[i + 1], fused)]
            i += 2
            continue
        elif plan.wanted(child, path):
            plan.done[id(child)] = _linear(child)
            plan.edits.append((module, name, plan.done[id(child)]))
        else:
            plan.done[id(child)] = child
            _plan_children(child, path + ".", plan)
        i += 1


def convert(model: nn.Module, fuse_layernorm: bool = True,
            module_filter: ModuleFilter | None = None, *, recipe: Recipe | None = None,
            fp8_group=None, eval_fp8: bool = True) -> nn.Module:  # fmt: skip
    """Replaces nn.Linear (and LayerNorm + Linear pairs of an nn.Sequential) by graphfp8 layers
    in place; the new layers hold the same Parameter objects, so tied weights stay tied.

    Args:
        model: the module to convert (an nn.Linear itself gives a new graphfp8.Linear).
        fuse_layernorm: fuse an nn.LayerNorm with the nn.Linear after it in an nn.Sequential.
        module_filter: module_filter(linear, name) -> False keeps that nn.Linear (name: its
            path in the model, e.g. "blocks.0.fc1") as it is; None converts every one.
        recipe: the FP8 recipe the model then carries (graphfp8.modules.carry): each call runs
            in FP8 by itself, with no fp8_autocast in the training loop (forward hooks on the
            model; graphs refuse them: capture a model converted without a recipe).
        fp8_group, eval_fp8: the carried settings (FP8Carry); need a recipe.

    Returns:
        The model.

    Raises:
        ValueError: before anything changes, naming every nn.Linear that a graphfp8.Linear
            cannot replace (module docstring) and why.
    """
    if INIT.enabled:
        raise RuntimeError(
            "graphfp8.convert keeps the model's own (high-precision) Parameters, so it cannot "
            "make FP8 primary weights: build the model from graphfp8 layers inside "
            "fp8_model_init and load_state_dict the high-precision weights (they are quantized)"
        )
    fp8 = FP8Carry(recipe, fp8_group, eval_fp8) if recipe is not None else None
    plan = _Plan(fuse_layernorm, module_filter)
    single = isinstance(model, nn.Linear)
    if single:
        single = plan.wanted(model, "")
    else:
        plan.done[id(model)] = model
        _plan_children(model, "", plan)
    if plan.refusals:
        raise ValueError(
            "graphfp8.convert: nothing was converted; "
            + "; ".join(plan.refusals)
            + ". Leave a layer as it is with convert(model, module_filter=lambda m, name: "
            "name != '...')"
        )
    if single:
        model = _linear(model)
    else:
        for parent, key, new in plan.edits:
            parent._modules[key] = new
        if plan.edits:  # a checkpoint one layer refuses loads nothing (check_fp8_entries)
            model.register_load_state_dict_pre_hook(fp8_entries_hook)
    if fp8 is not None:
        carry(model, fp8)
    return model
