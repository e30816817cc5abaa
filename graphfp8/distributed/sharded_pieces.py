"""The sharded masters' pieces (what the optimizer steps) and their gradients: views of the fp32
slices whose norms refuse and whose clearing clears the model's gradients (sharded_masters.py)."""

from __future__ import annotations

import torch

from graphfp8.fp8.master import TENSOR_GRAD

__all__ = ["Piece", "ShardGrad"]

_NORMS = (torch._foreach_norm, torch.linalg.vector_norm, torch.linalg.norm, torch.norm,
          torch.Tensor.norm)  # fmt: skip
_ZEROS = (torch.Tensor.zero_, torch._foreach_zero_)


def _owner(t: torch.Tensor):
    """The ShardedMasterWeights of a piece or of its gradient (None once it is gone)."""
    ref = getattr(t, "_graphfp8_owner", None)
    return ref() if ref is not None else None


class ShardGrad(torch.Tensor):
    """A piece's gradient: a plain view of the fp32 gradient slice that refuses to be a norm's
    input, so that torch.nn.utils.clip_grad_norm_(masters.parameters()) raises instead of
    clipping by this rank's norm."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _ZEROS:  # opt.zero_grad(set_to_none=False): the model's gradients, as DDP
            grads = args[0] if func is torch._foreach_zero_ else [args[0]]
            for g in grads:
                if (owner := _owner(g)) is not None:
                    owner.clear_for_piece(g._graphfp8_clears, set_to_none=False)
        elif func in _NORMS:
            raise RuntimeError(
                "the masters are sharded (MasterWeights(shard_group=...)): a norm of their "
                "gradients here is this rank's slice only; clip with masters.clip_grad_norm_("
                "max_norm), which returns the global norm"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class Piece(torch.Tensor):
    """One parameter's part of this rank's fp32 master slice (a view), what the optimizer
    steps. Its `.grad` is always its view of the reduced gradient slice, rewritten by every
    reduction (a norm of it raises: ShardGrad); clearing it (opt.zero_grad()) clears the
    model's gradients, as opt.zero_grad() does under DDP."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def grad(self):
        return TENSOR_GRAD.__get__(self)

    @grad.setter
    def grad(self, value) -> None:
        if value is not None:
            raise RuntimeError(
                "the gradient of a sharded master is its slice of the reduced gradients, "
                "written by masters.step / clip_grad_norm_; it cannot be replaced"
            )
        if (owner := _owner(self)) is not None:  # opt.zero_grad(): the model's, as in DDP
            owner.clear_for_piece(self._graphfp8_clears, set_to_none=True)

    @grad.deleter
    def grad(self) -> None:
        pass
