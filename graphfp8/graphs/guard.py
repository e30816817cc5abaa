"""What a captured graph assumes about the user's modules, checked before every replay.

A graph holds raw pointers to the parameters and buffers it read at capture, runs no Python (no
hooks), and folds the gradients of the parameters that required grad then into `.grad`. Changes
after capture would go unnoticed: load_state_dict(assign=True) or `module.weight = ...` (the
graph keeps the old tensor), `model.layer = other` (it keeps running the old layer),
`param.data = ...` or `module.to(dtype)` (new storage), requires_grad_ on a parameter (its
`.grad` would still, or never, be written), a forward hook on a submodule, a tensor hook on a
parameter (never run). Each check is one C-level pass over a precomputed list (no Python per
parameter), so it runs on every call (about 1 us per parameter, measured on the loaded 2-core
CI machine).
"""

from __future__ import annotations

import operator

import torch
from torch.nn.modules import module as _nn_module

__all__ = ["CaptureGuard", "build_guard", "hook_dicts", "tensor_hooks"]

_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    _nn_module._global_forward_hooks,
    _nn_module._global_forward_pre_hooks,
    _nn_module._global_backward_hooks,
    _nn_module._global_backward_pre_hooks,
)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD_STATE = operator.attrgetter("requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
_RECAPTURE = "call reset() on the graphed callable and capture again"


def hook_dicts(modules) -> list:
    """Every hook dict that would make a captured module run Python the graph cannot hold."""
    return [getattr(m, n) for m in modules for n in _MODULE_HOOKS] + list(_GLOBAL_HOOKS)


def tensor_hooks(params) -> list[str]:
    """Indices of tensors with hooks of their own (register_hook, post-accumulate-grad)."""
    return [i for i, p in enumerate(params) if p._backward_hooks or p._post_accumulate_grad_hooks]


class CaptureGuard:
    """The captured modules' hooks, parameter and buffer objects, storages and requires_grad.

    Args:
        name: the graphed callable's name, for messages.
        modules: every module the callable runs (found ones included).
        params: the parameters whose gradients the graphs compute, with names.
        tensors: every parameter and buffer the modules hold: (owner dict, key, tensor, name).
        children: every submodule slot: (owner's _modules, key, child module, name).
    """

    def __init__(self, name: str, modules, params: list[tuple[str, torch.Tensor]], tensors,
                 children=()):  # fmt: skip
        self.name = name
        self.hook_dicts = hook_dicts(modules)
        self.modules = list(modules)
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.requires_grad = list(map(_REQUIRES_GRAD, self.params))
        # One C-level pass reads all three per parameter; hook dicts emptied by handle.remove()
        # are not None, so a mismatch is looked at more closely before raising.
        self._grad_state = [(rg, None, None) for rg in self.requires_grad]
        slots = list(tensors) + list(children)
        self.owners = [d for d, _, _, _ in slots]
        self.keys = [k for _, k, _, _ in slots]
        self.objects = [t for _, _, t, _ in slots]
        self.object_names = [n for _, _, _, n in slots]
        self.tensors = [t for _, _, t, _ in tensors]
        self.tensor_names = [n for _, _, _, n in tensors]
        self.data_ptrs = list(map(torch.Tensor.data_ptr, self.tensors))

    def check(self) -> None:
        """Raises RuntimeError naming what changed since capture; nothing has run yet."""
        if any(self.hook_dicts):
            raise RuntimeError(
                f"{self.name}: hooks were registered on a captured module (or globally) after "
                f"capture; a captured graph would not run them. Remove them, or {_RECAPTURE}"
            )
        if not all(map(operator.is_, map(dict.get, self.owners, self.keys), self.objects)):
            self._raise_replaced()
        if list(map(torch.Tensor.data_ptr, self.tensors)) != self.data_ptrs:
            self._raise_moved()
        if list(map(_GRAD_STATE, self.params)) != self._grad_state:
            if list(map(_REQUIRES_GRAD, self.params)) != self.requires_grad:
                self._raise_requires_grad()
            hooked = tensor_hooks(self.params)
            if hooked:
                names = [self.param_names[i] for i in hooked]
                raise RuntimeError(
                    f"{self.name}: tensor hooks were registered on parameters {names} after "
                    "capture; the captured backward folds their gradients into .grad without "
                    f"running hooks. Remove them, or {_RECAPTURE}"
                )

    def _raise_replaced(self):
        names = [
            n
            for d, k, t, n in zip(
                self.owners, self.keys, self.objects, self.object_names, strict=True
            )
            if d.get(k) is not t
        ]
        raise RuntimeError(
            f"{self.name}: {names} were replaced after capture (load_state_dict(assign=True), an "
            "assignment of a tensor or submodule); the graphs still run the old ones. "
            f"Copy new values in place (load_state_dict without assign), or {_RECAPTURE}"
        )

    def _raise_moved(self):
        names = [
            n
            for t, p, n in zip(self.tensors, self.data_ptrs, self.tensor_names, strict=True)
            if t.data_ptr() != p
        ]
        raise RuntimeError(
            f"{self.name}: the storage of {names} changed after capture (`.data = ...`, "
            f".to(), .half() on the module); the graphs still read the old storage. Copy new "
            f"values in place, or {_RECAPTURE}"
        )

    def _raise_requires_grad(self):
        names = [
            f"{n} ({was} -> {p.requires_grad})"
            for p, n, was in zip(self.params, self.param_names, self.requires_grad, strict=True)
            if p.requires_grad != was
        ]
        raise RuntimeError(
            f"{self.name}: requires_grad of {names} changed after capture; the captured backward "
            "computes exactly the gradients that were required at capture. Change it back, or "
            f"{_RECAPTURE}"
        )


def build_guard(runner) -> CaptureGuard:
    """What the runner's graphs assume about its modules. A plain function's modules are those it
    closes over whose parameters it was found to use; they must have no hooks either."""
    if runner.closure:
        used = {id(p) for p in runner.params}
        tops = [c for c in runner.closure if any(id(p) in used for p in c.parameters())]
        runner.modules = list({id(m): m for c in tops for m in c.modules()}.values())
        if any(hook_dicts(runner.modules)):
            raise RuntimeError(f"{runner.name}: modules must have no hooks when captured")
    owned, tensors, children = set(), [], []
    for m in runner.modules:
        for table in (m._parameters, m._buffers):
            for key, t in table.items():
                if t is not None:
                    tensors.append((table, key, t, f"{type(m).__name__}.{key}"))
                    owned.add(id(t))
        children += [(m._modules, k, c, f"{type(m).__name__}.{k}") for k, c in m._modules.items()]
    for p, name in zip(runner.params, runner.param_names, strict=True):
        if id(p) not in owned:
            tensors.append(({"t": p}, "t", p, name))
    params = list(zip(runner.param_names, runner.params, strict=True))
    return CaptureGuard(runner.name, runner.modules, params, tensors, children)
