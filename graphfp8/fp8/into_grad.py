"""The weight-gradient GEMM writing straight into the parameter's `.grad` (WGRAD_INTO_GRAD).

One cuBLASLt FP8 GEMM with C = D = `.grad`, fp32 accumulation, beta read from device memory - 0
where `.grad` is None (it gets the product), 1 where it holds the gradient so far - in place of
a separate bf16 dW, eager AccumulateGrad's add or the graphs' fold of it, and their -0.0 fill
(docs/fp8.md, "Weight-gradient accumulation"; notes/PERF.md, "Gradient accumulation at Llama
shapes"). Off by default: GRAPHFP8_WGRAD_INTO_GRAD=1 turns it on.

Eager (`loss.backward()`): the GEMM writes `weight.grad` (allocated first where it is None, beta
0; beta 1 otherwise) and autograd gets no gradient for the weight. A backward that does not
store into `.grad` (`torch.autograd.grad` over the weight, `backward(inputs=...)` without it,
create_graph=True) and a weight or `.grad` the GEMM cannot write as eager AccumulateGrad would
(a `.grad` or grad_dtype other than the GEMM's output dtype, not contiguous or 16-byte aligned,
a tensor subclass, a tensor hook on the weight) take today's path: dW returned to autograd.

Graphs: the capture's gradient fold (graphs/grads.py GradFold; the step graph's StepGrads,
graphs/step_grads.py) opens a `Target` for its backward; the GEMM writes the parameter's
persistent `.grad` buffer with the target's (alpha, beta) device pair: for a layer or microbatch
graph the weight's first write in the graph reads a beta that the accumulator's reset graph sets
to 0 before the first microbatch of a step and the backward graph back to 1 at its end; the step
graph's first microbatch writes with beta 0, the others with 1. Any other capture (a warmup,
FSDP2's graphs, which refuse the switch, a user's CUDA graph) takes today's path.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from graphfp8 import global_state, ops
from graphfp8.fp8 import context
from graphfp8.ops.switches import env_switch

__all__ = ["SWITCH", "Target", "capturing", "plain", "switched_on", "write_wgrad", "wrote"]

SWITCH = "WGRAD_INTO_GRAD"


class Target(Protocol):
    """A capture that takes weight gradients into its parameters' `.grad` buffers."""

    def into_grad(self, weight: torch.Tensor, dtype: torch.dtype):
        """(buffer, alpha_beta) the GEMM writes `weight`'s gradient into, or None (today's
        path)."""

    def wrote(self, weight: torch.Tensor) -> bool:
        """Whether this capture's GEMMs wrote `weight`'s gradient."""


_TARGETS: list[Target] = []  # the open captures' targets, innermost last
# {device: (2, 2) float32 [[1, 0], [1, 1]]}: eager's (alpha, beta) rows, made outside captures.
_EAGER_SCALARS: dict[torch.device, torch.Tensor] = {}


def _reset() -> None:
    _TARGETS.clear()
    _EAGER_SCALARS.clear()


global_state.register("WGRAD_INTO_GRAD's capture targets and eager scalars (fp8/into_grad.py)",
                      _reset, lambda: not _TARGETS and not _EAGER_SCALARS,
                      layer=global_state.FP8)  # fmt: skip


def plain(weight: torch.Tensor, buffer: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a capture's GEMM may write `weight`'s gradient into `buffer`: a plain parameter
    (not an FP8 primary weight) and a plain buffer of the GEMM's output dtype."""
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and type(buffer) is torch.Tensor
            and buffer.dtype == dtype)  # fmt: skip


def switched_on() -> bool:
    """Whether GRAPHFP8_WGRAD_INTO_GRAD is on (default off until its H200 run)."""
    return env_switch(SWITCH)


@contextlib.contextmanager
def capturing(target: Target):
    """Routes the weight-gradient GEMMs of the block (a capture's backward) to `target`."""
    _TARGETS.append(target)
    try:
        yield
    finally:
        _TARGETS.remove(target)


def wrote(weight: torch.Tensor) -> bool:
    """Whether an open capture's GEMMs wrote `weight`'s gradient into its `.grad` buffer (so that
    autograd gave it none)."""
    return any(t.wrote(weight) for t in _TARGETS)


def write_wgrad(weight, dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv, out_dtype) -> bool:
    """Writes dW (N, K) = dy.T @ x into weight.grad (or, inside a capture, the target's buffer)
    when the path applies; returns whether it did (then autograd must get None for the weight).

    Args:
        weight: the parameter (N, K) the gradient belongs to, or None (today's path).
        dy_t_fp8: (N, M) FP8; x_t_fp8: (K, M) FP8; their (1,) float32 scale_invs.
        out_dtype: the dtype dW would have (the grad output's).
    """
    if weight is None or dy_t_fp8.shape[1] == 0:
        return False
    if _TARGETS:
        got = _TARGETS[-1].into_grad(weight, out_dtype)
        if got is None:
            return False
        _gemm(dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv, *got)
        return True
    if not (switched_on() and _eager_applies(weight, out_dtype)):
        return False
    grad = weight.grad
    first = grad is None
    if first:
        grad = torch.empty_like(weight, memory_format=torch.contiguous_format)
    _gemm(dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv, grad, _eager_scalars(weight.device, first))
    if first:
        weight.grad = grad
    return True


def _gemm(dy_t_fp8, dy_scale_inv, x_t_fp8, x_scale_inv, out, alpha_beta) -> None:
    ops.fp8_gemm_into_(dy_t_fp8, dy_scale_inv, x_t_fp8.t(), x_scale_inv, out, alpha_beta)


def _eager_scalars(device: torch.device, first: bool) -> torch.Tensor:
    """(alpha, beta) = (1, 0) for the first write of a .grad, else (1, 1), on `device`."""
    table = _EAGER_SCALARS.get(device)
    if table is None:
        table = torch.tensor([[1.0, 0.0], [1.0, 1.0]], device=device)
        _EAGER_SCALARS[device] = table
    return table[0 if first else 1]


def _eager_applies(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether an eager backward stores `weight`'s gradient into a .grad the GEMM can write as
    AccumulateGrad would: outside any capture, a plain leaf parameter of the GEMM's output dtype
    without tensor hooks, a .grad that is None or a plain contiguous, 16-byte aligned tensor of
    its dtype and shape, no create_graph, and the engine running the weight's AccumulateGrad."""
    if context.current().capturing or _cuda_capturing():
        return False
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.dtype != dtype:
        return False
    if getattr(weight, "grad_dtype", dtype) != dtype:  # AccumulateGrad would cast the gradient
        return False
    if not (weight.is_leaf and weight.requires_grad) or weight._backward_hooks:
        return False
    if torch.is_grad_enabled():  # create_graph=True: AccumulateGrad adds out of place
        return False
    grad = weight.grad
    if grad is not None and not (
        type(grad) is torch.Tensor
        and grad.dtype == dtype
        and grad.shape == weight.shape
        and grad.device == weight.device
        and grad.is_contiguous()
        and not grad.requires_grad
        and grad.data_ptr() % 16 == 0
    ):
        return False
    return _accumulates(weight)


def _cuda_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _accumulates(weight: torch.Tensor) -> bool:
    """Whether the running backward executes `weight`'s AccumulateGrad (loss.backward(),
    backward(inputs=[weight])); torch.autograd.grad over the weight returns its gradient
    instead (the engine raises for that leaf), other backwards leave it alone."""
    with torch.enable_grad():
        node = weight.view_as(weight).grad_fn.next_functions[0][0]
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False
