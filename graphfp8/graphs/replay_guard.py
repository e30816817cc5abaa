"""The replay-time guard of every entry point (graphed callables, microbatch and step graphs):
what a captured graph assumes about the modules and tensors it read, checked before every replay
in O(1) Python (docs/after-capture.md lists what it sees and what it cannot).

A graph holds raw pointers to the parameters and buffers it read at capture, runs no Python (no
hooks) and computes exactly the gradients that were required then. Changes after capture would go
unnoticed: load_state_dict(assign=True) or `module.weight = ...` (the graph keeps the old tensor),
`model.layer = other` (it keeps running the old layer), `param.data = ...` or `module.to(dtype)`
(new storage), requires_grad_ on a parameter (its `.grad` would still, or never, be written), a
hook on a module, globally or on a parameter (never run), `w.main_grad = ...` on a weight whose
gradient the graph adds into its main_grad (graphs/main_grad_guard.py).

Cost per call, flat in model size: one int compared (the modules' dicts count their writes,
graphs/watch.py), four global hook dicts tested for emptiness, and one C++ loop over the tensors
(`graphfp8.ops.TensorWatch`, ~10 ns a tensor: storage pointer, requires_grad, tensor hooks). Only
when one of those moved does the Python path below look at everything, to word the error or, when
nothing the graph depends on changed (a hook added and removed, another model's module changed),
to remember the new count. Weights under fuse_wgrad_accumulation add one identity test each.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.graphs.main_grad_guard import MainGradGuard
from graphfp8.graphs.watch import CHANGES, MODULE_HOOKS, watch_modules
from graphfp8.ops import TensorWatch

__all__ = ["GLOBAL_HOOKS", "ReplayGuard", "any_hook", "hook_dicts", "tensor_hooks"]

GLOBAL_HOOKS = (
    _nn_module._global_forward_hooks,
    _nn_module._global_forward_pre_hooks,
    _nn_module._global_backward_hooks,
    _nn_module._global_backward_pre_hooks,
)


def hook_dicts(modules) -> list:
    """Every hook dict that would make a captured module run Python the graph cannot hold."""
    return [getattr(m, n) for m in modules for n in MODULE_HOOKS] + list(GLOBAL_HOOKS)


def tensor_hooks(tensors) -> list[int]:
    """Indices of tensors with hooks of their own (register_hook, post-accumulate-grad)."""
    return [i for i, t in enumerate(tensors) if t._backward_hooks or t._post_accumulate_grad_hooks]


def any_hook(dicts, allowed=None) -> bool:
    """Whether a hook dict holds a hook that allowed(hook) does not accept (None: any hook)."""
    if allowed is None:
        return any(dicts)
    return any(not allowed(h) for d in dicts for h in d.values())


def module_names(roots) -> dict[int, str]:
    """{id(module): qualified name} under the (label, root module) pairs, for messages."""
    names: dict[int, str] = {}
    for label, root in roots:
        for name, m in root.named_modules(remove_duplicate=False):
            names.setdefault(id(m), ".".join(p for p in (label, name) if p))
    return names


class ReplayGuard:
    """What one captured graph (or graph pair) assumes about the modules and tensors it reads.

    Args:
        name: what raises (a graphed callable's name, "make_graphed_step"), for messages.
        modules: every module the graph runs (a module callable's tree, the modules a plain
            function closes over, a step graph's model).
        names: {id(module): qualified name} for messages (module_names()).
        params: the parameters whose gradients the graph computes, with their names; those
            that no module holds are watched as tensors.
        recapture: what the user does to capture again (the end of every message).
        allowed_hook: allowed_hook(hook) accepts a module hook the capture ran (FSDP2's own:
            graphs/fsdp.py); None: no module hook is allowed.
        added: {id(weight): weight} whose gradient the capture added into their main_grad
            (CaptureSession.added); those among the parameters watched here get a MainGradGuard.
    """

    def __init__(self, name: str, modules, names: dict[int, str], params, recapture: str,
                 allowed_hook=None, added=None):  # fmt: skip
        self.name, self.recapture, self.allowed_hook = name, recapture, allowed_hook
        self.modules = list({id(m): m for m in modules}.values())
        watch_modules(self.modules)
        self.hook_dicts = hook_dicts(self.modules)
        # (owner dict, key, object, name): every parameter, buffer and submodule slot.
        self.slots: list[tuple[dict, str, object, str]] = []
        self.tensors: list[torch.Tensor] = []
        self.tensor_names: list[str] = []
        self.is_param: list[bool] = []
        seen: set[int] = set()
        for m in self.modules:
            prefix = names.get(id(m), type(m).__name__)
            for table, is_param in ((m._parameters, True), (m._buffers, False)):
                for key, t in table.items():
                    label = f"{prefix}.{key}" if prefix else key
                    self.slots.append((table, key, t, label))  # None too: a bias set later
                    if t is not None:
                        self._add(t, label, is_param, seen)
            for key, child in m._modules.items():
                self.slots.append((m._modules, key, child, f"{prefix}.{key}" if prefix else key))
        for label, p in params:
            self._add(p, label, True, seen)
        added = added or {}
        self.main_grads = MainGradGuard(name, [
            (n, t) for t, n, p in zip(self.tensors, self.tensor_names, self.is_param, strict=True)
            if p and id(t) in added and isinstance(getattr(t, "main_grad", None), torch.Tensor)
        ], recapture)  # fmt: skip
        for label, g in self.main_grads.tensors():
            self._add(g, label, False, seen)
        self.requires_grad = [t.requires_grad for t in self.tensors]
        self.data_ptrs = [t.data_ptr() for t in self.tensors]
        self._watch = TensorWatch(self.tensors, self.is_param)
        self._seen = CHANGES.value

    def _add(self, t: torch.Tensor, label: str, is_param: bool, seen: set[int]) -> None:
        if id(t) not in seen:
            seen.add(id(t))
            self.tensors.append(t)
            self.tensor_names.append(label)
            self.is_param.append(is_param)
            if isinstance(t, Float8Tensor):  # its bytes and scale_inv are what graphs read
                self._add(t._data, f"{label} data", False, seen)
                self._add(t._scale_inv, f"{label} scale_inv", False, seen)
            local = getattr(t, "_local_tensor", None)  # an FSDP2 shard: what its graph reads
            if isinstance(local, torch.Tensor):
                self._add(local, f"{label} local shard", False, seen)

    def check(self) -> None:
        """Raises RuntimeError naming what changed since capture; nothing has run yet."""
        g = GLOBAL_HOOKS
        if CHANGES.value != self._seen or g[0] or g[1] or g[2] or g[3]:
            self._check_modules()
        if self._watch.first_changed() >= 0:
            self._raise_tensors()
        self.main_grads.check()

    def _fail(self, what: str, advice: str) -> RuntimeError:
        return RuntimeError(f"{self.name}: {what}. {advice}, or {self.recapture}")

    def _check_modules(self) -> None:
        """The slow path: a watched dict was written (anywhere) or a global hook exists."""
        seen = CHANGES.value
        if any_hook(self.hook_dicts, self.allowed_hook):
            raise self._fail(
                "hooks were registered on a captured module (or globally) after capture; a "
                "captured graph would not run them",
                "Remove them",
            )
        replaced = [n for d, k, obj, n in self.slots if d.get(k) is not obj]
        if replaced:
            raise self._fail(
                f"{replaced} were replaced after capture (load_state_dict(assign=True), an "
                "assignment of a tensor or submodule); the graphs still run the old ones",
                "Copy new values in place (load_state_dict without assign)",
            )
        self._seen = seen

    def _raise_tensors(self):
        moved = [
            n
            for t, p, n in zip(self.tensors, self.data_ptrs, self.tensor_names, strict=True)
            if t.data_ptr() != p
        ]
        if moved:
            raise self._fail(
                f"the storage of {moved} changed after capture (`.data = ...`, .to(), .half() on "
                "the module); the graphs still read the old storage",
                "Copy new values in place",
            )
        flipped = [
            f"{n} ({was} -> {t.requires_grad})"
            for t, n, was, p in zip(self.tensors, self.tensor_names, self.requires_grad,
                                    self.is_param, strict=True)
            if p and t.requires_grad != was
        ]  # fmt: skip
        if flipped:
            raise self._fail(
                f"requires_grad of {flipped} changed after capture; the captured backward "
                "computes exactly the gradients that were required at capture",
                "Change it back",
            )
        hooked = [self.tensor_names[i] for i in tensor_hooks(self.tensors) if self.is_param[i]]
        raise self._fail(
            f"tensor hooks were registered on parameters {hooked} after capture; the captured "
            "backward folds their gradients into .grad without running hooks",
            "Remove them",
        )


def owner_modules(closure: list[nn.Module], params) -> list[nn.Module]:
    """The modules of a plain function's guard: the trees of the closed-over modules whose
    parameters it was found to use."""
    used = {id(p) for p in params}
    tops = [c for c in closure if any(id(p) in used for p in c.parameters())]
    return list({id(m): m for c in tops for m in c.modules()}.values())
