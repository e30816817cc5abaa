"""Meta kernels for torch's fused Adam/AdamW with a tensor learning rate, which torch lacks: without
them DTensor's sharding propagation of an FSDP2 optimizer step runs the real kernel on zeros of the
parameters' global shapes (docs/sharding.md, "The first optimizer step under FSDP2").

torch registers meta kernels for `_fused_adam_` / `_fused_adamw_` with a float learning rate only.
`torch.optim.AdamW(fused=True, lr=<tensor>)` calls the `tensor_lr` overloads; on DTensor
parameters (FSDP2, FSDPMasterWeights) DTensor dispatch computes the output's metadata by running
the op under FakeTensorMode, which, finding no meta kernel, falls back to running the CPU or CUDA
kernel on real zero tensors of the fake arguments' shapes - the unsharded shapes of parameters,
gradients and both moments: 16 bytes per fp32 parameter on every rank, at the first step of each
set of shapes (pytorch/pytorch#140874). The kernels below compute nothing: the in-place ops return
nothing, the functional ones empty tensors shaped as their inputs, as torch's own meta kernels of
the float-lr overloads do. The real step is untouched, so its bits are too.
"""

from __future__ import annotations

import torch

__all__ = ["FUSED_OPTIMIZER_OVERLOADS", "register_fused_optimizer_meta"]

# (aten overload, in place): the fused Adam/AdamW overloads that DTensor dispatches (its pointwise
# ops) and that fell back to real kernels under FakeTensorMode (torch 2.13)
FUSED_OPTIMIZER_OVERLOADS = (
    ("_fused_adam_.tensor_lr", True),
    ("_fused_adamw_.tensor_lr", True),
    ("_fused_adam.tensor_lr", False),
    ("_fused_adamw.tensor_lr", False),
)

_LIB: torch.library.Library | None = None


def _check_lists(lists) -> None:
    kinds = [type(tensors) for tensors in lists]
    torch._check(all(issubclass(k, (list, tuple)) for k in kinds),
                 lambda: f"fused Adam expects tensor lists, got {kinds}")  # fmt: skip


def _meta_in_place(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                   **kwargs) -> None:  # fmt: skip
    """The in-place step: writes its arguments only, so there is nothing to compute."""
    _check_lists((params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps))


def _meta_functional(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                     **kwargs) -> tuple:  # fmt: skip
    """The functional step: new params, grads, moments and max moments shaped as the inputs."""
    lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
    _check_lists((*lists, state_steps))
    return tuple([torch.empty_like(t) for t in tensors] for tensors in lists)


def register_fused_optimizer_meta() -> list[str]:
    """Registers the meta kernels of FUSED_OPTIMIZER_OVERLOADS that torch does not have (a later
    torch's own kernel is kept). Idempotent; called when graphfp8.distributed is imported.

    Returns:
        The overloads registered by this call.
    """
    global _LIB
    registered = []
    for name, in_place in FUSED_OPTIMIZER_OVERLOADS:
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta"):
            continue
        if _LIB is None:
            _LIB = torch.library.Library("aten", "IMPL")
        _LIB.impl(name, _meta_in_place if in_place else _meta_functional, "Meta")
        registered.append(name)
    return registered
