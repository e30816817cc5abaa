"""One captured callable as its replays see it: the call contract (CallContract: what every call
must pass, checked before anything runs) and the graph pair (GraphPair: the two graphs, their
static buffers and replays), joined with their capture's CapturedGraphs (graphs/lifecycle.py: the
schedule, the FP8 settings, the weight-cache flag and torch.autocast state, held once per
capture) in a GraphedRunner. Built once at the end of make_graphed_callables and frozen; the
autograd.Function that replays a pair is graphs/function.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_unflatten

from graphfp8.graphs.capture_checks import inside_ddp_forward
from graphfp8.nvtx_ranges import nvtx_range

__all__ = ["CallContract", "GraphPair", "GraphedRunner", "InputSpec", "copy_inputs", "needs_copy",
           "storages_of"]  # fmt: skip


def storages_of(tensors) -> frozenset[int]:
    """The storages (data pointers) of static buffers, for copy_inputs."""
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if t.numel())


def copy_inputs(pairs: list[tuple[torch.Tensor, torch.Tensor]], storages: frozenset[int]) -> None:
    """Copies each (given, static) pair's given tensor into its static buffer. When a given
    tensor lives in a static buffer (one passed at another position), every given tensor is read
    whole before anything is written: a buffer written first would change it."""
    if len(pairs) > 1 and any(g.numel() and g.untyped_storage().data_ptr() in storages
                              for g, _ in pairs):  # fmt: skip
        pairs = [(g.clone(), s) for g, s in pairs]
    for given, static in pairs:
        static.copy_(given)


def needs_copy(given: torch.Tensor, static: torch.Tensor) -> bool:
    """Whether a replay must copy `given` into `static` (it is not that buffer, as laid out)."""
    return given is not static and (
        given.data_ptr() != static.data_ptr() or given.stride() != static.stride()
    )


def _tensor_text(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}, requires_grad={t.requires_grad}"


@dataclass(frozen=True)
class InputSpec:
    """What every call must pass, fixed at capture (the checks compare these, nothing else).

    Attributes:
        kwarg_names: the keyword arguments, in the order of the static inputs.
        shapes, dtypes, devices, requires_grad: of each flat input (args, then kwargs).
        alias_of: for each position, the first position that held the same sample tensor.
    """

    kwarg_names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[torch.device, ...]
    requires_grad: tuple[bool, ...]
    alias_of: tuple[int, ...]

    @classmethod
    def of(cls, static_inputs, kwarg_names, alias_of) -> InputSpec:
        return cls(tuple(kwarg_names), tuple(t.shape for t in static_inputs),
                   tuple(t.dtype for t in static_inputs), tuple(t.device for t in static_inputs),
                   tuple(t.requires_grad for t in static_inputs), tuple(alias_of))  # fmt: skip

    def text(self, i: int) -> str:
        """Input i as the messages describe a tensor."""
        return (f"{tuple(self.shapes[i])} {self.dtypes[i]} on {self.devices[i]}, "
                f"requires_grad={self.requires_grad[i]}")  # fmt: skip

    @property
    def copies(self) -> tuple[int, ...]:
        """The positions a replay copies into (one per distinct static input)."""
        return tuple(i for i, a in enumerate(self.alias_of) if a == i)


@dataclass(frozen=True, eq=False, repr=False)
class CallContract:
    """What every call of one graphed callable must pass (frozen at capture).

    Attributes:
        name: "graphed callable j (Type)", for messages.
        index: its place in its capture's schedule (the runner index of schedule.Layout).
        guard: what it assumes about its modules (graphs/replay_guard.py).
        uses_fp8: it runs FP8 modules (inside fp8_autocast it must match the region).
        spec: the inputs every call must pass.
        chained: its input 0 is the previous callable's static output 0 (chain=True).
        expects_grad: a forward with grad enabled leaves a backward to run.
        recipe: the recipe it was captured under, None without FP8 (its own, with
            make_graphed_callables' per-callable fp8_enabled / fp8_recipe).
    """

    name: str
    index: int
    guard: object
    uses_fp8: bool
    spec: InputSpec
    chained: bool
    expects_grad: bool
    recipe: object = None

    def flat_inputs(self, args, kwargs) -> list:
        """The call's tensors in the order of the static inputs, checked against the spec."""
        spec = self.spec
        if kwargs or spec.kwarg_names:
            if sorted(kwargs) != sorted(spec.kwarg_names):
                raise TypeError(
                    f"{self.name}: captured with keyword arguments {sorted(spec.kwarg_names)}, "
                    f"called with {sorted(kwargs)}"
                )
            flat = list(args) + [kwargs[k] for k in spec.kwarg_names]
        else:
            flat = list(args)
        if len(flat) != len(spec.shapes):
            raise TypeError(
                f"{self.name}: captured with {len(spec.shapes)} tensor arguments, called with "
                f"{len(flat)}"
            )
        for i, a in enumerate(flat):
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{self.name}: argument {i} must be a tensor, got {type(a)}")
            if (a.shape != spec.shapes[i] or a.dtype != spec.dtypes[i]
                    or a.requires_grad != spec.requires_grad[i]
                    or a.device != spec.devices[i]):  # fmt: skip
                raise ValueError(
                    f"{self.name}: argument {i} is {_tensor_text(a)}, but the graph was captured "
                    f"for {spec.text(i)}; capture another graph for other inputs"
                )
        if len(flat) > 1:
            self._check_aliasing(flat)
        return flat

    def _check_aliasing(self, flat) -> None:
        """Positions that held one sample tensor must hold one tensor (the graph reads one
        buffer for them); distinct ones that require grad must be distinct (each gets its own
        gradient, which autograd would sum in another order than eager mode does)."""
        alias_of = self.spec.alias_of
        given: dict[int, int] = {}
        for i, t in enumerate(flat):
            first = given.setdefault(id(t), i)
            if alias_of[i] != i and flat[alias_of[i]] is not t:
                raise ValueError(
                    f"{self.name}: captured with one tensor at arguments {alias_of[i]} and {i} "
                    "(its gradient summed once, as eagerly); pass one tensor at both, or "
                    "capture with distinct sample tensors"
                )
            if first != i and alias_of[i] == i and t.requires_grad:
                raise ValueError(
                    f"{self.name}: arguments {first} and {i} are one tensor, but the graph was "
                    "captured with distinct tensors there; capture with the same tensor at both "
                    "positions (sample_args=(s, s, ...)) to get eager's gradient"
                )


@dataclass(frozen=True, eq=False, repr=False)
class GraphPair:
    """One callable's two graphs, their static buffers and their replays (frozen at capture;
    release() empties it).

    Attributes:
        fwd_graph, bwd_graph: the two graphs (graphs/backends.py; each replay reports the
            scale updates its graph holds to graphfp8/fp8/scale_schedule.py).
        static_inputs: the flat tensors the forward graph reads (args, then kwargs; positions
            that held one sample tensor hold one static tensor).
        copies: the positions replay_forward copies into (InputSpec.copies).
        storages: those of the static inputs (copy_inputs).
        static_outputs: flat output tensors the forward graph writes; out_spec rebuilds them.
        read_back: the static outputs and inputs that the captured backward reads (saved for
            backward at capture), with their names: a write into one between a call and its
            backward is refused, as eager autograd refuses it.
        static_grad_outputs: one buffer per output that requires grad (None otherwise).
        static_grad_inputs: one gradient per input position; None where there is none.
        accumulator: the parameter gradients' fold into .grad (graphs/grads.py), or None.
        grad_anchor: makes the outputs require grad when only parameters do.
        anchor_node: grad_anchor's AccumulateGrad node (None when it does not require grad): a
            backward that will not run it asks for a subset of the gradients.
    """

    fwd_graph: object
    bwd_graph: object
    static_inputs: list[torch.Tensor]
    copies: tuple[int, ...]
    storages: frozenset[int]
    static_outputs: list[torch.Tensor]
    out_spec: object
    read_back: list[torch.Tensor]
    read_back_names: tuple[str, ...]
    static_grad_outputs: list[torch.Tensor | None]
    static_grad_inputs: list[torch.Tensor | None]
    accumulator: object
    grad_anchor: torch.Tensor
    anchor_node: object

    def replay_forward(self, flat_inputs) -> None:
        static = self.static_inputs
        pairs = [(flat_inputs[i], static[i]) for i in self.copies
                 if needs_copy(flat_inputs[i], static[i])]  # fmt: skip
        if pairs:
            copy_inputs(pairs, self.storages)
        with nvtx_range("replay-forward"):
            self.fwd_graph.replay()

    def versions(self) -> tuple[int, ...]:
        """The version counters of read_back, as a forward replay leaves them."""
        return tuple(t._version for t in self.read_back)

    def check_versions(self, name: str, versions: tuple[int, ...]) -> None:
        """Raises before a backward replay if the caller wrote into a static tensor that it
        reads since the forward (`out.mul_(2)` of an output the backward reads)."""
        now = self.versions()
        if now == versions:
            return
        names = [n for n, a, b in zip(self.read_back_names, versions, now, strict=True) if a != b]
        raise RuntimeError(
            f"{name}: {', '.join(names)} of the call was modified by an in-place operation "
            "before its backward, and the captured backward reads it (eager autograd refuses "
            "this backward too: 'one of the variables needed for gradient computation has been "
            "modified by an inplace operation'). Modify a clone (out = out.clone()), or run the "
            "backward first"
        )

    def replay_backward(self, grads) -> tuple:
        for static, given in zip(self.static_grad_outputs, grads, strict=True):
            if static is not None and given is not None and static.data_ptr() != given.data_ptr():
                static.copy_(given)
        acc = self.accumulator
        with nvtx_range("replay-backward"):
            if acc is None:
                self.bwd_graph.replay()
            elif torch._C._will_engine_execute_node(self.anchor_node):
                acc.before_replay()
                self.bwd_graph.replay()
                acc.after_replay()
            else:  # torch.autograd.grad(loss, x), backward(inputs=[x]): .grad stays as it was
                acc.replay_leaving_grads(self.bwd_graph)
        # Returned without detach(): the pair keeps a reference, so AccumulateGrad clones them
        # into a leaf input's .grad instead of stealing a static buffer that the next replay
        # overwrites.
        return tuple(self.static_grad_inputs)

    def outputs(self, flat):
        return tree_unflatten(list(flat), self.out_spec)

    def release(self) -> None:
        """Drops the graphs and static buffers (reset()); the pair stays, empty."""
        for g in (self.fwd_graph, self.bwd_graph, getattr(self.accumulator, "reset_graph", None)):
            if g is not None:
                g.release()
        for buffers in (self.static_inputs, self.static_outputs, self.static_grad_outputs,
                        self.static_grad_inputs, self.read_back):  # fmt: skip
            buffers.clear()


@dataclass(frozen=True, eq=False, repr=False)
class GraphedRunner:
    """One captured callable: its call contract, its graph pair, and its capture (the
    CapturedGraphs of graphs/lifecycle.py, shared by every runner of the capture)."""

    contract: CallContract
    pair: GraphPair
    capture: object

    def __repr__(self) -> str:
        return f"GraphedRunner({self.contract.name!r})"

    def check_call(self, args, kwargs, is_first_microbatch) -> list:
        """Validates a call before anything runs; returns the flat user tensors."""
        contract, capture = self.contract, self.capture
        if capture.closed:
            raise RuntimeError(
                f"{contract.name}: reset() released its graphs; call make_graphed_callables again"
            )
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(
                f"{contract.name}: called inside a backward pass (the recompute of activation "
                "checkpointing, torch.utils.checkpoint, or a hook). A graph keeps its outputs "
                "in its static buffers, so checkpointing around it saves no memory, and the "
                "recompute would replay its forward (with its FP8 scale update) a second time "
                "for one backward. Call the graphed callable outside checkpoint, and recompute "
                "inside it: capture layers built with TransformerLayer(recompute='full' or "
                "'selective') or whose forward calls graphfp8.recompute"
            )
        capture.check_fp8_region(contract)
        capture.autocast.check(contract.name)
        inside_ddp_forward(contract.name)
        flat = contract.flat_inputs(args, kwargs)
        if contract.chained and needs_copy(flat[0], self.pair.static_inputs[0]):
            self._check_chain_input()
        contract.guard.check()
        capture.schedule.check_forward(contract.index)
        capture.flag.set(is_first_microbatch)
        return flat

    def _check_chain_input(self) -> None:
        """chain=True: static input 0 is the previous callable's output buffer. Another tensor is
        copied into it, which is safe only while no backward still needs that output."""
        if self.capture.schedule.is_pending(self.contract.index - 1):
            raise ValueError(
                f"{self.contract.name}: captured with chain=True, it reads the previous "
                "callable's output buffer; pass it that output (or capture without chain=True "
                "for inputs from elsewhere): copying another tensor there would overwrite what "
                "the previous callable's pending backward may read"
            )
