"""The optimizer inside a step graph: which torch optimizers can be captured, the learning rate as
a device tensor, the checks made before every replay, and the snapshot that undoes warmup.

A captured optimizer must read everything that changes between steps from the device: torch's
Adam and AdamW with capturable=True keep the step count on the device (on the CPU, where torch
refuses capturable, their fused kernels do the same), and SGD's fused kernel reads a tensor
learning rate. Python numbers (betas, eps, weight decay, momentum) are frozen at capture.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.optim import SGD, Adam, AdamW
from torch.optim import optimizer as _torch_optimizer

from graphfp8.fp8.main_grad import main_grads
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.graphs.backends import host_memory

__all__ = ["OptimizerGuard", "TrainingSnapshot", "check_optimizer"]

_SUPPORTED = (Adam, AdamW, SGD)


def _group_error(name: str, opt, index: int, what: str) -> ValueError:
    return ValueError(f"{name}: {type(opt).__name__} param group {index} cannot be captured: "
                      f"{what}")  # fmt: skip


def _check_group(name: str, opt, index: int, group: dict, device: torch.device) -> None:
    if group.get("differentiable"):
        raise _group_error(name, opt, index, "differentiable=True runs autograd in step()")
    if isinstance(opt, SGD):
        if not group.get("fused"):
            raise _group_error(
                name, opt, index,
                "construct SGD with fused=True (its other forms read a tensor learning rate "
                "back to the host, or freeze a float one into the graph)",
            )  # fmt: skip
        if group["momentum"] != 0:
            missing = [p for p in group["params"] if "momentum_buffer" not in opt.state.get(p, {})]
            if missing:
                raise _group_error(
                    name, opt, index,
                    "SGD with momentum creates its momentum buffers on its first step, which "
                    "computes differently from the later ones; run the first optimizer step "
                    "eagerly (or load the optimizer's state), then capture",
                )  # fmt: skip
    elif device.type == "cuda" and not group.get("capturable"):
        raise _group_error(
            name, opt, index,
            "construct it with capturable=True (it then keeps its step count on the GPU)",
        )  # fmt: skip
    elif device.type == "cpu" and not group.get("fused"):
        raise _group_error(
            name, opt, index,
            "on the CPU construct it with fused=True (torch runs capturable=True on GPUs only; "
            "the fused CPU kernel reads the step count and learning rate from tensors too)",
        )  # fmt: skip
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or lr.device != device or lr.requires_grad:
            raise _group_error(
                name, opt, index,
                f"a tensor learning rate must be one element on {device} without grad, got "
                f"{tuple(lr.shape)} on {lr.device}, requires_grad={lr.requires_grad}",
            )  # fmt: skip
        if lr.dtype != torch.float32:
            raise _group_error(name, opt, index, f"a tensor learning rate must be float32, "
                               f"got {lr.dtype}")  # fmt: skip


def check_optimizer(name: str, optimizer, params: list[torch.Tensor], device) -> None:
    """Raises unless `optimizer` can run inside a step graph; then turns every float learning
    rate into a float32 device tensor (in place), which an LR schedule may update between replays
    (torch's LR schedulers fill_ tensor learning rates).

    Args:
        name: prefix of error messages.
        optimizer: the torch optimizer.
        params: the model's trainable parameters; the optimizer must hold exactly these.
        device: their device.
    """
    if type(optimizer) not in _SUPPORTED:
        raise TypeError(
            f"{name}: cannot capture {type(optimizer).__module__}.{type(optimizer).__name__}; "
            "the step graph supports torch.optim.Adam, AdamW (capturable=True) and SGD "
            "(fused=True). Other optimizers: graph the microbatches (make_graphed_microbatch) "
            "and step the optimizer eagerly"
        )
    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             _torch_optimizer._global_optimizer_pre_hooks,
             _torch_optimizer._global_optimizer_post_hooks)  # fmt: skip
    if any(hooks):
        raise RuntimeError(f"{name}: the optimizer has step hooks, which a graph does not run")
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if {id(p) for p in held} != {id(p) for p in params} or len(held) != len(params):
        raise ValueError(
            f"{name}: the optimizer must hold exactly the model's {len(params)} trainable "
            f"parameters, each once; it holds {len(held)} parameters"
            + ("" if len({id(p) for p in held}) == len(held) else " (some twice)")
        )
    device = torch.device(device)
    for i, group in enumerate(optimizer.param_groups):
        _check_group(name, optimizer, i, group, device)
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


class OptimizerGuard:
    """What a step graph froze of its optimizer, checked before every replay: the state and
    param-group containers (load_state_dict replaces them), the tensor learning rates (by
    identity) and every other hyperparameter (by value)."""

    def __init__(self, name: str, optimizer) -> None:
        self.name, self.optimizer = name, optimizer
        self.groups, self.state = optimizer.param_groups, optimizer.state
        self.frozen = [[(k, v) for k, v in g.items() if k != "params"] for g in self.groups]

    def check(self) -> None:
        opt = self.optimizer
        if opt.param_groups is not self.groups or opt.state is not self.state or len(
            self.groups) != len(self.frozen):  # fmt: skip
            raise RuntimeError(
                f"{self.name}: the optimizer's state or param groups were replaced or extended "
                "after capture (load_state_dict, add_param_group); capture the step again"
            )
        for group, frozen in zip(self.groups, self.frozen, strict=True):
            for key, value in frozen:
                now = group.get(key)
                if now is value:
                    continue
                if isinstance(value, torch.Tensor) or isinstance(now, torch.Tensor) or now != value:
                    advice = (
                        "Change a learning rate in place (group['lr'].fill_(value), as torch's "
                        "LR schedulers do)"
                        if key == "lr"
                        else "Put it back, or capture the step again with the new value"
                    )
                    raise RuntimeError(
                        f"{self.name}: the optimizer's {key!r} changed after capture ({value!r} "
                        f"-> {now!r}); the graph replays the captured one. {advice}"
                    )


def _fp8_local(t: torch.Tensor) -> torch.Tensor:
    """The Float8Tensor local shard of an FSDP2 FP8 weight (read at each use: FSDP2 replaces it,
    padded, at its lazy init), else `t` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, Float8Tensor) else t


class TrainingSnapshot:
    """The model's parameters and buffers and the optimizer's state, put back after warmup and
    after a CPU capture (whose tape runs what it records). State that the optimizer created in
    between is zeroed: the supported optimizers create it as zeros (Adam's step count and moments;
    SGD's momentum buffers must exist before capture).

    The copy lives in host memory (pinned for a GPU's tensors), so that the GPU holds no second
    copy of the weights and masters while warmup and capture run (the capture's peak), and the
    session drops it once the capture has put the state back (graphs/session.py;
    docs/sharding.md, "Memory planner")."""

    def __init__(self, model: nn.Module, optimizer=None, extra=()) -> None:
        """extra: more tensors the step changes (FP8 primary weights' masters and scales)."""
        # The main gradients that fused weight-gradient GEMMs add into too (fp8/main_grad.py).
        grads = main_grads(model.parameters())
        self.tensors = [*itertools.chain(model.parameters(), model.buffers(), grads, extra)]
        with torch.no_grad(), host_memory():
            self.saved = [_host_copy(t.detach()) for t in self.tensors]
            self.optimizer = optimizer
            self.state = {}
            if optimizer is not None:
                for p, s in optimizer.state.items():
                    self.state[p] = {k: _host_copy(v.detach()) if isinstance(v, torch.Tensor)
                                     else v for k, v in s.items()}  # fmt: skip

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved, strict=True):
                _fp8_local(t).copy_(saved)
            if self.optimizer is None:
                return
            for p, state in self.optimizer.state.items():
                saved = self.state.get(p, {})
                for key, value in state.items():
                    if key in saved and isinstance(value, torch.Tensor):
                        value.copy_(saved[key])
                    elif key in saved:
                        state[key] = saved[key]
                    elif isinstance(value, torch.Tensor):
                        value.zero_()


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in host memory, pinned when t is a plain tensor on a GPU. An FP8 weight
    (Float8Tensor or Float8BlockTensor) stays one, rebuilt from host copies of its inner tensors
    (its transpose is not kept: copy_ back marks it stale, as after load_state_dict)."""
    if _fp8_local(t) is not t:  # an FSDP2 FP8 weight: its local Float8Tensor shard
        return _host_copy(_fp8_local(t).detach())
    if isinstance(t, Float8Tensor):
        names, meta = t.__tensor_flatten__()
        inner = {n: _host_copy(getattr(t, n)) for n in names}
        return type(t).__tensor_unflatten__(inner, meta, t.shape, t.stride())
    if t.device.type == "cpu" or type(t) is not torch.Tensor:
        return t.clone()  # other subclasses (DTensor) keep their copy on their device
    try:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")
    except RuntimeError:  # no pinned memory left: pageable, the same values, slower copies
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.copy_(t)
