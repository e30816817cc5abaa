"""Replaying a captured callable: its static inputs and outputs (GraphedRunner), the checks made
before every replay, the is_first_microbatch device flag (WeightCacheFlag) and the
autograd.Function that replays the two graphs, in the order its capture's Schedule allows (the
gradient fold into `.grad`: graphs/grads.py)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_unflatten

from graphfp8.fp8.autocast import check_is_first_microbatch
from graphfp8.graphs.grads import GradAccumulator
from graphfp8.graphs.replay_guard import ReplayGuard, hook_dicts
from graphfp8.profiling import nvtx_range

__all__ = ["GradAccumulator", "GraphedFunction", "GraphedRunner", "WeightCacheFlag", "hook_dicts"]


class WeightCacheFlag:
    """The device flag that the captured weight casts read (1 = the cached FP8 weight is valid:
    the cast writes nothing; the kernels call such a flag `noop`).

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
        check_is_first_microbatch(is_first_microbatch)
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


def _tensor_text(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}, requires_grad={t.requires_grad}"


class GraphedRunner:
    """One captured callable: its graphs and static buffers.

    Attributes:
        index: its place in its capture's schedule (the runner index of schedule.Layout).
        static_inputs: the flat user tensors the forward graph reads (sample args, then kwargs).
        params: the parameters whose gradients go through `accumulator`, not autograd: the
            module's own and those its outputs were found to depend on (graphs/discover.py).
        param_names: a name per parameter, for messages.
        modules: every module it runs (its own tree, or those a plain function closes over).
        closure: for a plain function, the modules it closes over (candidates for `modules`).
        uses_fp8: it runs FP8 modules (inside fp8_autocast it must match the region).
        arenas: {id: arena} of the FP8 arenas its modules used while warming up.
        graphs: the CapturedGraphs of its capture (schedule, FP8 settings, reset).
        guard: what it assumes about its modules, checked before every call.
        static_outputs: flat output tensors the forward graph writes; out_spec rebuilds them.
        static_grad_outputs: one buffer per output that requires grad (None otherwise).
        static_grad_inputs: one gradient per static input; None where there is none.
        expects_grad: a forward with grad enabled leaves a backward to run.
    """

    def __init__(self, name, static_inputs, kwarg_names, params, modules, param_names=None):
        self.name = name
        self.index = 0
        self.static_inputs = static_inputs
        self.kwarg_names = kwarg_names
        self.params = tuple(params)
        self.param_names = list(param_names or [f"parameter {i}" for i in range(len(params))])
        self.modules = list(modules)
        self.closure: list = []  # modules a plain function closes over (graphs/discover.py)
        self.arenas: dict = {}
        self.uses_fp8 = False
        self.weight_cache_flag: WeightCacheFlag | None = None  # set by the capturer
        self.graphs = None  # set by the capturer
        self.guard: ReplayGuard | None = None
        self.fwd_graph = self.bwd_graph = None
        self.static_outputs: list[torch.Tensor] = []
        self.out_spec = None
        self.static_grad_outputs: list[torch.Tensor | None] = []
        self.static_grad_inputs: list[torch.Tensor | None] = []
        self.accumulator: GradAccumulator | None = None
        self.expects_grad = False
        self.undo = None  # puts a module's eager forward back (set by _wrap)
        # Makes the outputs require grad when only parameters do (see GraphedFunction).
        self.grad_anchor = torch.empty(0, requires_grad=any(p.requires_grad for p in params))

    def adopt(self, params, names) -> None:
        """Adds parameters found outside the callable's own (graphs/discover.py)."""
        self.params = self.params + tuple(params)
        self.param_names += list(names)
        self.grad_anchor.requires_grad_(any(p.requires_grad for p in self.params))

    def check_call(self, args, kwargs, is_first_microbatch) -> list:
        """Validates a call before anything runs; returns the flat user tensors."""
        if self.graphs.closed:
            raise RuntimeError(
                f"{self.name}: reset() released its graphs; call make_graphed_callables again"
            )
        self.graphs.check_fp8_region(self)
        if (kwargs or self.kwarg_names) and sorted(kwargs) != sorted(self.kwarg_names):
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
        for i, (a, s) in enumerate(zip(flat, self.static_inputs, strict=True)):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{self.name}: argument {i} must be a tensor, got {type(a)}")
            if (a.shape != s.shape or a.dtype != s.dtype or a.device != s.device
                    or a.requires_grad != s.requires_grad):  # fmt: skip
                raise ValueError(
                    f"{self.name}: argument {i} is {_tensor_text(a)}, but the graph was captured "
                    f"for {_tensor_text(s)}; capture another graph for other inputs"
                )
        self.guard.check()
        self.graphs.schedule.check_forward(self.index)
        self.weight_cache_flag.set(is_first_microbatch)
        return flat

    def replay_forward(self, flat_inputs) -> None:
        for static, given in zip(self.static_inputs, flat_inputs, strict=True):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        with nvtx_range("replay-forward"):
            self.fwd_graph.replay()

    def replay_backward(self, grads) -> tuple:
        for static, given in zip(self.static_grad_outputs, grads, strict=True):
            if static is not None and given is not None and static.data_ptr() != given.data_ptr():
                static.copy_(given)
        with nvtx_range("replay-backward"):
            if self.accumulator is not None:
                self.accumulator.before_replay()
            self.bwd_graph.replay()
            if self.accumulator is not None:
                self.accumulator.after_replay()
        # Returned without detach(): the runner keeps a reference, so AccumulateGrad clones
        # them into a leaf input's .grad instead of stealing a static buffer that the next
        # replay overwrites.
        return tuple(self.static_grad_inputs)

    def outputs(self, flat):
        return tree_unflatten(list(flat), self.out_spec)

    def release(self) -> None:
        """Drops the graphs and static buffers (reset())."""
        graphs = [self.fwd_graph, self.bwd_graph]
        if self.accumulator is not None:
            graphs.append(self.accumulator.reset_graph)
        for g in graphs:
            if g is not None:
                g.release()
        self.fwd_graph = self.bwd_graph = self.accumulator = None
        self.static_inputs, self.static_outputs = [], []
        self.static_grad_outputs, self.static_grad_inputs = [], []


class GraphedFunction(torch.autograd.Function):
    """Replays the forward graph in forward and the backward graph in backward.

    Inputs: the runner, whether this call leaves a backward to run, the grad anchor (an empty
    tensor that requires grad when the parameters do, so the outputs require grad even if no
    user input does), the user tensors. The autograd node (ctx) is what the schedule tracks:
    while it lives, the runner's backward is pending.
    """

    @staticmethod
    def forward(ctx, runner: GraphedRunner, expects_backward: bool, anchor, *inputs):
        ctx.runner = runner
        runner.replay_forward(inputs)
        runner.graphs.schedule.forward_done(runner.index, ctx if expects_backward else None)
        outs = tuple(o.detach() for o in runner.static_outputs)
        ctx.mark_non_differentiable(
            *[o for o, g in zip(outs, runner.static_grad_outputs, strict=True) if g is None]
        )
        return outs

    @staticmethod
    def backward(ctx, *grads):
        runner: GraphedRunner = ctx.runner
        if runner.graphs.closed:
            raise RuntimeError(
                f"{runner.name}: backward through outputs made before reset() released the graphs"
            )
        runner.graphs.schedule.check_backward(runner.index, ctx)
        grad_inputs = runner.replay_backward(grads)
        runner.graphs.schedule.backward_done(runner.index)
        return (None, None, None, *grad_inputs)
