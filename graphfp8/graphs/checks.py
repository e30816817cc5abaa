"""What make_graphed_callables refuses before anything runs: warmup counts and recipes it cannot
honour, and callables whose modules cannot be captured."""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.fp8.recipe import check_recipe
from graphfp8.graphs.discover import closure_modules
from graphfp8.graphs.lifecycle import check_not_captured
from graphfp8.graphs.replay import GraphedRunner
from graphfp8.graphs.replay_guard import hook_dicts, tensor_hooks
from graphfp8.modules.base import FP8Module

__all__ = ["check_distinct", "check_options", "fp8_modules_of", "new_runner"]


def check_options(num_warmup_iters, fp8_enabled: bool, fp8_recipe) -> None:
    """Raises for a warmup count or recipe that make_graphed_callables cannot honour."""
    iters = num_warmup_iters
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(
            f"make_graphed_callables: num_warmup_iters must be an int >= 0, got {iters!r}"
        )
    if fp8_enabled and iters < 1:
        raise ValueError(
            "make_graphed_callables: fp8_enabled needs num_warmup_iters >= 1: the warmup finds "
            "the FP8 arenas whose scale updates the graphs hold (without it they held none, and "
            "every scale stayed 1.0)"
        )
    check_recipe(fp8_recipe, "make_graphed_callables: fp8_recipe")


def check_distinct(callables) -> None:
    """Raises if one module is given twice: its forward cannot replay two captures."""
    seen = {}
    for i, func in enumerate(callables):
        if id(func) in seen and isinstance(func, nn.Module):
            raise ValueError(
                f"make_graphed_callables: callables {seen[id(func)]} and {i} are the same "
                f"{type(func).__name__}; to capture a layer for several microbatches of a "
                "pipeline schedule, pass it once and give order="
            )
        seen[id(func)] = i


def new_runner(j: int, func, flat, kwarg_names) -> GraphedRunner:
    """The runner of callable `func` with static inputs `flat`, after checking that its inputs
    are tensors and that its modules can be captured: none replays another capture, none has
    hooks (module, global, parameter tensor hooks)."""
    name = f"graphed callable {j} ({type(func).__name__})"
    for t in flat:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: sample args and kwargs must be tensors, got {type(t)}")
    modules, named, closure = [], [], []
    if isinstance(func, nn.Module):
        modules = list(func.modules())
        check_not_captured(name, modules)
        if any(hook_dicts(modules)):
            raise RuntimeError(f"{name}: modules must have no hooks when captured")
        named = list(func.named_parameters())
    else:
        closure = closure_modules(func)
        check_not_captured(name, [m for c in closure for m in c.modules()])
    runner = GraphedRunner(name, flat, kwarg_names, [p for _, p in named], modules,
                           [n for n, _ in named])  # fmt: skip
    runner.index, runner.closure = j, closure
    hooked = tensor_hooks(runner.params)
    if hooked:
        raise RuntimeError(
            f"{name}: parameters {[runner.param_names[i] for i in hooked]} have tensor hooks; "
            "the captured backward folds gradients into .grad without running them"
        )
    return runner


def fp8_modules_of(runner: GraphedRunner) -> list[FP8Module]:
    """The FP8 modules of a module callable, or of the modules a plain function closes over."""
    trees = runner.modules + [m for c in runner.closure for m in c.modules()]
    return [m for m in {id(m): m for m in trees}.values() if isinstance(m, FP8Module)]
