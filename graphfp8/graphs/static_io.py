"""Static inputs and outputs of a captured callable, the checks made before every replay, the
is_first_microbatch device flag, and the autograd.Function that replays the two graphs."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_unflatten

from graphfp8.autocast import STATE

__all__ = ["WeightFlag", "GraphedRunner", "GraphedFunction"]


class WeightFlag:
    """The device noop flag that the captured weight casts read (1 = skip, reuse the cache).

    It is refreshed by an eager fill_ enqueued before a replay, only when its value changes: with
    N microbatches per step that is 2 fills per step (True -> 0, then False -> 1), none on the
    other replays. A stream-ordered device write cannot race with the replays around it, unlike
    a pinned host value read by a memcpy node of the graph.
    """

    def __init__(self, tensor: torch.Tensor | None, fp8_enabled: bool, caching: bool):
        self.tensor = tensor
        self.fp8_enabled = fp8_enabled
        self.caching = caching
        self.value = 0.0
        self.seen_first = False

    def set(self, is_first_microbatch) -> None:
        if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
            raise TypeError(
                f"is_first_microbatch must be None, True or False, got {is_first_microbatch!r}"
            )
        if self.tensor is None:
            if self.fp8_enabled and is_first_microbatch is not None:
                raise ValueError(
                    "make_graphed_callables(fp8_weight_caching=False) casts the weights on every "
                    "replay; call the graphed callable with is_first_microbatch=None"
                )
            return
        if is_first_microbatch is False:
            if not self.seen_first:
                raise RuntimeError(
                    "graphed callable called with is_first_microbatch=False before any call "
                    "with is_first_microbatch=True: there is no cached FP8 weight to reuse"
                )
            value = 1.0
        else:
            self.seen_first = self.seen_first or bool(is_first_microbatch)
            value = 0.0
        if value != self.value:
            self.tensor.fill_(value)
            self.value = value


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}, requires_grad={t.requires_grad}"


class GraphedRunner:
    """One captured callable: its graphs and static buffers.

    Attributes:
        static_inputs: the flat user tensors the forward graph reads (sample args, then kwargs).
        params: module parameters, inputs of the autograd.Function after the user tensors.
        static_outputs: flat output tensors the forward graph writes; out_spec rebuilds them.
        static_grad_outputs: one buffer per output that requires grad (None otherwise).
        static_grad_inputs: one gradient per (static input, param); None where there is none.
    """

    def __init__(self, name, static_inputs, kwarg_names, params, modules, flag):
        self.name = name
        self.static_inputs = static_inputs
        self.kwarg_names = kwarg_names
        self.params = params
        self.modules = modules
        self.flag = flag
        self.fwd_graph = self.bwd_graph = None
        self.static_outputs: list[torch.Tensor] = []
        self.out_spec = None
        self.static_grad_outputs: list[torch.Tensor | None] = []
        self.static_grad_inputs: list[torch.Tensor | None] = []

    def check_call(self, args, kwargs, is_first_microbatch, full_hook_check: bool) -> list:
        """Validates a call before anything runs; returns the flat user tensors."""
        if STATE.enabled and STATE.capture is None:
            raise RuntimeError(
                f"{self.name}: a graphed callable carries its own FP8 state and scale updates; "
                "call it outside fp8_autocast"
            )
        if sorted(kwargs) != sorted(self.kwarg_names):
            raise TypeError(
                f"{self.name}: captured with keyword arguments {sorted(self.kwarg_names)}, "
                f"called with {sorted(kwargs)}"
            )
        flat = list(args) + [kwargs[k] for k in self.kwarg_names]
        if len(flat) != len(self.static_inputs):
            raise TypeError(
                f"{self.name}: captured with {len(self.static_inputs)} tensor arguments, "
                f"called with {len(flat)}"
            )
        for i, (a, s) in enumerate(zip(flat, self.static_inputs)):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{self.name}: argument {i} must be a tensor, got {type(a)}")
            if (a.shape != s.shape or a.dtype != s.dtype or a.device != s.device
                    or a.requires_grad != s.requires_grad):  # fmt: skip
                raise ValueError(
                    f"{self.name}: argument {i} is {_describe(a)}, but the graph was captured "
                    f"for {_describe(s)}; capture another graph for other inputs"
                )
        mods = self.modules if full_hook_check else self.modules[:1]
        for m in mods:
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks \
                    or m._backward_pre_hooks:  # fmt: skip
                raise RuntimeError(
                    f"{self.name}: {type(m).__name__} has hooks registered after capture; "
                    "a captured graph would not run them"
                )
        self.flag.set(is_first_microbatch)
        return flat

    def replay_forward(self, flat_inputs) -> None:
        for static, given in zip(self.static_inputs, flat_inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self.fwd_graph.replay()

    def replay_backward(self, grads) -> tuple:
        for static, given in zip(self.static_grad_outputs, grads):
            if static is not None and given is not None and static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self.bwd_graph.replay()
        # Returned without detach(): the runner keeps a reference, so AccumulateGrad clones
        # them into .grad (set_to_none=True) or adds them, instead of stealing a static buffer
        # that the next replay overwrites.
        return tuple(self.static_grad_inputs)

    def outputs(self, flat):
        return tree_unflatten(list(flat), self.out_spec)


class GraphedFunction(torch.autograd.Function):
    """Replays the forward graph in forward and the backward graph in backward."""

    @staticmethod
    def forward(ctx, runner: GraphedRunner, *inputs):
        ctx.runner = runner
        runner.replay_forward(inputs[: len(runner.static_inputs)])
        outs = tuple(o.detach() for o in runner.static_outputs)
        ctx.mark_non_differentiable(
            *[o for o, g in zip(outs, runner.static_grad_outputs) if g is None]
        )
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.runner.replay_backward(grads))
