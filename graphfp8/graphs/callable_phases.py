"""The capture phases of make_graphed_callables, as in torch/cuda/graphs.py: the sample each
callable is captured with, warmup, the forwards in order, the backwards in reverse. Each capture
phase returns what it built (Forward, Backward); graphs/callables.py assembles the runners.

What runs where on every microbatch (one forward replay and one backward replay per graph):

    first forward graph of a unit:  the fused scale update of the forward arenas its modules use
                                    (after the MAX all-reduce of the amaxes over fp8_group; the
                                    update points: graphfp8/fp8/scale_schedule.py)
    forward graphs:                 weight cast-transpose guarded by the device weight-cache flag,
                                    activation casts with amax, GEMMs
    backward graphs:                grad casts with amax, GEMMs, the fold into .grad
    last backward graph of a unit:  the fused update of its backward arenas
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from graphfp8.fp8.main_grad import is_fused
from graphfp8.fp8.scale_schedule import UpdatePoints
from graphfp8.graphs.capture_checks import check_capturable, check_inputs_alias
from graphfp8.graphs.compiled import compile_set_aside
from graphfp8.graphs.contexts import saved_storages
from graphfp8.graphs.discover import adopt_outside_leaves, closure_modules, next_sequence_nr
from graphfp8.graphs.grads import GradAccumulator, GradFold, check_into_grad
from graphfp8.graphs.session import CaptureSession

__all__ = ["NAME", "Backward", "Forward", "Sample", "capture_backwards", "capture_forwards",
           "prepare", "warmup"]  # fmt: skip

NAME = "make_graphed_callables"


@dataclass
class Sample:
    """One (callable, sample inputs) pair while it is being captured: what the phases read and
    the parameters they find (graphs/discover.py adopts those outside the callable's own).

    Attributes:
        static_inputs: the flat tensors the graphs read (args, then kwargs); a sample tensor
            given at several positions is one static tensor (alias_of says where).
        params, param_names: the callable's parameters (a module's own, then adopted ones).
        modules: a module callable's tree; closure: the modules a plain function closes over.
        arenas: {id: arena} of the FP8 arenas its modules used while warming up (what its
            warmup recordings returned).
        callable_index: which of the callables given it runs (its FP8 setting:
            CaptureOptions.recipes).
        fsdp: an FSDP2 layer's FSDPLayer (graphs/fsdp_layers.py): its forward and backward run
            FSDP2's all-gather, reshard and reduce-scatter; its params are the unsharded ones.
    """

    index: int
    name: str
    func: object
    static_inputs: list[torch.Tensor]
    kwarg_names: list[str]
    alias_of: list[int]
    params: list[torch.Tensor]
    param_names: list[str]
    modules: list[nn.Module]
    closure: list[nn.Module]
    arenas: dict = field(default_factory=dict)
    callable_index: int = 0
    fsdp: object = None

    def adopt(self, params, names) -> None:
        self.params += list(params)
        self.param_names += list(names)

    def call(self):
        """Runs the callable on the static inputs; returns (flat outputs, their tree spec)."""
        n_args = len(self.static_inputs) - len(self.kwarg_names)
        args = self.static_inputs[:n_args]
        kwargs = dict(zip(self.kwarg_names, self.static_inputs[n_args:], strict=True))
        with compile_set_aside():
            if self.fsdp is not None:
                out = self.fsdp.run(self.func, args, kwargs)
            else:
                out = self.func(*args, **kwargs)
        flat, spec = tree_flatten(out)
        for t in flat:
            if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
                raise TypeError(f"{self.name}: outputs must be plain tensors, got {type(t)}")
        return flat, spec

    def grad_inputs(self) -> list[torch.Tensor]:
        """What a backward differentiates: each distinct static input that requires grad, in
        position order, then the parameters that do (but those whose gradient a layer adds into
        their main_grad: graphfp8/fp8/main_grad.py)."""
        distinct = [t for i, t in enumerate(self.static_inputs) if self.alias_of[i] == i]
        params = [p for p in self.params if not is_fused(p)]
        return [t for t in distinct + params if t.requires_grad]

    def per_position(self, grads) -> list[torch.Tensor | None]:
        """The input gradients among `grads` (grad_inputs() order), one per input position."""
        it = iter(grads)
        return [next(it) if self.alias_of[i] == i and t.requires_grad else None
                for i, t in enumerate(self.static_inputs)]  # fmt: skip


@dataclass
class Forward:
    """A captured forward: its graph (with the scale updates it holds), the static outputs it
    writes, and the storages of the tensors it saved for its backward
    (contexts.saved_storages)."""

    graph: object
    outputs: list[torch.Tensor]
    out_spec: object
    saved: set[int]


@dataclass
class Backward:
    """A captured backward: its graph (with the scale updates it holds), its static grad
    outputs (one per output that requires grad), the gradient per input position, and the fold
    of the parameter gradients."""

    graph: object
    grad_outputs: list[torch.Tensor | None]
    grad_inputs: list[torch.Tensor | None]
    accumulator: GradAccumulator | None


# Phase 0: the samples ---------------------------------------------------------------------------


def prepare(funcs, sample_args, sample_kwargs, fsdp=None) -> tuple[list[Sample], torch.device]:
    """One Sample per (funcs[j], sample_args[j]) pair, after checking that its inputs are tensors
    that a graph can read and that it can be captured (capture_checks.check_capturable); returns
    them and the device. fsdp: one FSDPLayer per func (FSDP2 layers), or None: such a sample
    starts with no parameters, warmup finds the unsharded ones its forward uses."""
    if fsdp:
        check_into_grad(NAME, "FSDP2 layers")  # before any state changes (graphs/grads.py)
    samples, devices = [], set()
    fsdp = fsdp or [None] * len(funcs)
    for j, (func, args, kwargs) in enumerate(zip(funcs, sample_args, sample_kwargs, strict=True)):
        name = f"graphed callable {j} ({type(func).__name__})"
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        kwargs = dict(kwargs or {})
        flat = list(args) + list(kwargs.values())
        for t in flat:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: sample args and kwargs must be tensors, got {type(t)}")
        modules, named, closure = [], [], []
        if isinstance(func, nn.Module):
            modules, named = list(func.modules()), list(func.named_parameters())
            layer = func if fsdp[j] is None else fsdp[j].module  # FSDP2's checks: the layer
            check_capturable(NAME, name, layer, modules, named, index=j,
                             fsdp2_ok=fsdp[j] is not None)  # fmt: skip
        else:
            closure = closure_modules(func)
            check_capturable(NAME, name, func, [m for c in closure for m in c.modules()], index=j)
        alias_of = check_inputs_alias(name, flat)
        flat = _leaf_aliases(flat, alias_of)
        if fsdp[j] is not None:
            devices.update(p.device for _, p in named)
            named = []
        samples.append(Sample(j, name, func, flat, list(kwargs), alias_of, [p for _, p in named],
                              [n for n, _ in named], modules, closure, fsdp=fsdp[j]))  # fmt: skip
        devices.update(t.device for t in flat)
        devices.update(p.device for _, p in named)
    if len(devices) != 1:
        raise ValueError(f"{NAME}: all tensors must be on one device, got {devices}")
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{NAME}: unsupported device {device}")
    return samples, device


# Phase 1: warmup --------------------------------------------------------------------------------


def warmup(samples: list[Sample], iters: int, allow_unused: bool, session: CaptureSession) -> None:
    """Runs each callable forward and backward `iters` times. The first iteration finds the
    tensors requiring grad that the outputs depend on beyond the callable's own (adopted as its
    parameters); every one adds the FP8 arenas each callable used to sample.arenas."""
    with session.warmup():
        for it in range(iters):
            for s in samples:
                with session.recording(s.callable_index) as found:
                    since = next_sequence_nr() if it == 0 else 0
                    flat, _ = s.call()
                    if it == 0:
                        adopt_outside_leaves(s, flat, since)
                        if s.fsdp is not None:
                            s.param_names = s.fsdp.names(s.params)
                    outs, inputs = [o for o in flat if o.requires_grad], s.grad_inputs()
                    if outs and inputs:
                        _grad(s, outs, inputs, [torch.ones_like(o) for o in outs], allow_unused)
                    del flat, outs
                s.arenas.update(found.arenas)


def _grad(s: Sample, outs, inputs, grad_outputs, allow_unused: bool) -> tuple:
    """torch.autograd.grad of a callable's outputs; an FSDP2 layer's with FSDP2's backward around
    it (its parameters' gradients reduce-scattered into their sharded .grad, returned as None)."""
    if s.fsdp is None:
        return torch.autograd.grad(outs, inputs, grad_outputs, allow_unused=allow_unused)
    params = [p for p in s.params if p.requires_grad]
    return s.fsdp.backward(outs, inputs, grad_outputs, params, allow_unused)


# Phase 2: capture the forwards in order -------------------------------------------------------


def capture_forwards(samples: list[Sample], points: UpdatePoints, session: CaptureSession,
                     chain: bool) -> list[Forward]:  # fmt: skip
    """Captures one unit's forwards in order; the first graph opens with the unit's forward
    update point. With chain, each callable after the first reads the previous one's static
    output 0 as its input 0 (no copy between them)."""
    forwards = []
    for i, s in enumerate(samples):
        if chain and i > 0:
            s.static_inputs[0] = _chained_input(samples[i - 1], forwards[-1], s)
        graph = session.new_graph()
        since = next_sequence_nr()
        with session.capture_into(graph, s.callable_index) as found, saved_storages() as saved:
            if i == 0:
                points.at_forward()
            outputs, out_spec = s.call()
        if found.arenas.keys() - s.arenas.keys():
            raise RuntimeError(
                f"{s.name}: FP8 modules ran in the capture that did not run while warming up; "
                "a callable must run the same modules every time"
            )
        adopt_outside_leaves(s, outputs, since)
        forwards.append(Forward(graph, outputs, out_spec, saved))
    return forwards


def _leaf_aliases(flat: list[torch.Tensor], alias_of: list[int]) -> list[torch.Tensor]:
    """The static inputs: a copy of each distinct sample tensor, a leaf with its requires_grad
    (one copy where the sample gives one tensor at several positions). A copy, so that replays
    never write into the caller's sample (the microbatch and step graphs copy theirs too:
    docs/after-capture.md); a leaf, so that the capture's backward ends at the static inputs:
    through a sample's own grad_fn (qkv.chunk(3)'s views) it would run nodes recorded on another
    stream (on CUDA: "operation would make the legacy stream depend on a capturing blocking
    stream", H200 2026-12-01)."""
    leaves: dict[int, torch.Tensor] = {}
    for i, t in enumerate(flat):
        if alias_of[i] == i:
            leaves[i] = t.detach().clone().requires_grad_(t.requires_grad)
    return [leaves[alias_of[i]] for i in range(len(flat))]


def _chained_input(prev: Sample, prev_fwd: Forward, s: Sample) -> torch.Tensor:
    """s's static input 0 as a leaf over the previous callable's static output 0."""
    sample = s.static_inputs[0]
    out = prev_fwd.outputs[0] if prev_fwd.outputs else None
    if (
        out is None
        or out.shape != sample.shape
        or out.dtype != sample.dtype
        or any(a == 0 for a in s.alias_of[1:])
    ):
        raise ValueError(
            f"make_graphed_callables(chain=True): {s.name}'s first sample argument "
            f"{tuple(sample.shape)} {sample.dtype} must be what {prev.name} returns first "
            f"(its output is {None if out is None else (tuple(out.shape), out.dtype)}), given "
            "at no other position; capture without chain for callables fed from elsewhere"
        )
    return out.detach().requires_grad_(sample.requires_grad)


# Phase 3: capture the backwards in reverse order ----------------------------------------------


def capture_backwards(samples: list[Sample], forwards: list[Forward], points: UpdatePoints,
                      session: CaptureSession, allow_unused: bool,
                      chain: bool) -> list[Backward]:  # fmt: skip
    """Captures a unit's backwards in reverse; the last (samples[0]'s) ends with the unit's
    backward update point. With chain, each callable but the last reads the next one's input
    gradient as its grad output."""
    backwards: list[Backward | None] = [None] * len(samples)
    for i in reversed(range(len(samples))):
        s, fwd = samples[i], forwards[i]
        grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in fwd.outputs]
        if chain and i + 1 < len(samples) and grad_outputs and grad_outputs[0] is not None:
            nxt = backwards[i + 1].grad_inputs[0]
            if nxt is not None:
                grad_outputs[0] = nxt
        outs = [o for o in fwd.outputs if o.requires_grad]
        inputs = s.grad_inputs()
        graph = session.new_graph()
        fold = GradFold([] if s.fsdp is not None else s.params, session.device)
        with fold.hooked(), session.capture_into(graph, s.callable_index):
            grads = ()
            if outs and inputs:
                given = [g for g in grad_outputs if g is not None]
                grads = _grad(s, outs, inputs, given, allow_unused or fold.routes_into_grad)
                fold.check_unused(inputs, grads, allow_unused)
            fold.finish()
            if i == 0:
                points.at_backward()
        # The inputs' gradients, then the parameters' stand-ins (dropped).
        grad_inputs = s.per_position(grads)
        del grads
        if s.fsdp is not None:  # FSDP2 adds into the sharded .grad buffers (graphs/fsdp.py)
            acc = s.fsdp.grads.accumulator(session.device, session.pool)
            if s.fsdp.sync is not None:  # fsdp_sync="last": its sync graph (fsdp_layer_sync.py)
                acc = s.fsdp.sync.capture(s.fsdp, session, s.callable_index, acc)
            acc = s.fsdp.prefetch.wrap(acc)  # explicit prefetch's tokens (fsdp_prefetch.py)
        else:
            acc = fold.accumulator(session.pool)
        backwards[i] = Backward(graph, grad_outputs, grad_inputs, acc)
    return backwards
