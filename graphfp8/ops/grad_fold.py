"""Typed wrapper of the gradient fold of graphed callables: buffer = grad on the first microbatch
of a step, buffer + grad after it, chosen by a device flag (graphs/grads.py)."""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["grad_fold_"]


@wraps_op("grad_fold_")
def grad_fold_(buffer: torch.Tensor, grad: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """buffer = grad where first[0] != 0, else buffer + grad (torch's add: the same bits as
    `buffer.add_(grad)`, NaN included), in place.

    On CUDA one kernel that reads `first` from device memory, so a captured graph copies or adds
    as the flag stands at replay; on the CPU ATen's copy_ or add_ on the flag's value.

    Args:
        buffer: float32, bfloat16 or float16, contiguous: read (unless first) and written.
        grad: buffer's shape and dtype, on its device (made contiguous here if it is not).
        first: (1,) int32 on buffer's device.

    Returns:
        buffer.
    """
    ops.grad_fold_(buffer, grad.contiguous(), first)
    return buffer
