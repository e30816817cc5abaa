"""Parameter gradients of graphed callables: folded into each parameter's persistent `.grad` buffer
inside the backward graph, as autograd produces them (GradFold, at capture), with the replay-time
bookkeeping that keeps `.grad` bit for bit what eager AccumulateGrad gives (GradAccumulator)."""

from __future__ import annotations

import contextlib
import operator

import torch

from graphfp8.fp8 import into_grad
from graphfp8.fp8.main_grad import is_fused
from graphfp8.graphs.backends import host_memory, new_graph
from graphfp8.graphs.tape import CaptureError
from graphfp8.ops import GradWatch, grad_fold_
from graphfp8.ops.switches import env_switch

__all__ = ["FOLD_AT_ONCE", "GradAccumulator", "GradFold", "check_into_grad", "fill_minus_zero",
           "grad_buffer"]  # fmt: skip

_GRAD = operator.attrgetter("grad")
_ALL_BUFFERS, _ALL_NONE = 0, 1  # GradWatch.state(): every .grad is its buffer / is None


class GradAccumulator:
    """Parameter gradients of one captured callable, accumulated into `.grad` inside its backward
    graph, without autograd's AccumulateGrad.

    While the backward is captured, a hook on each parameter adds the gradient autograd produces
    into a persistent per-parameter buffer (small gradients: one multi-tensor add at the end of
    the graph) and hands autograd an empty stand-in, so that the gradient's memory goes back to
    the graph's pool at once: no static per-parameter gradient outlives the graph, and a big one
    does not even outlive its layer's backward. The graph always adds, as eager AccumulateGrad
    does from the second microbatch on. After zero_grad(set_to_none=True) AccumulateGrad steals
    the first gradient instead: before that replay one small captured graph fills the buffers
    with -0.0, the identity of IEEE addition (-0.0 + g is g bit for bit, +0.0 included), and
    `.grad` is set to them after it. A `.grad` the user replaced by another tensor is copied into
    the buffer before the replay and back after it (a slower per-parameter path).

    .. warning:: parameter hooks (post-accumulate-grad hooks, DDP's) do not run for these grads.
    """

    def __init__(self, params, buffers, reset_graph, flags=()):
        self.params, self.buffers, self.reset_graph = params, buffers, reset_graph
        # The device flags that the reset and backward graphs read and write (the copy-first
        # flag GradFold.first, the GEMMs' alpha and beta of WGRAD_INTO_GRAD): a CUDA graph holds
        # their addresses, not the tensors, so these references keep them allocated.
        self.flags = list(flags)
        self._nones = [None] * len(params)
        self._attach = None
        # Where every .grad stands, in one C++ pass (graphs/replay_guard.py says why C++).
        self._where = GradWatch(params, buffers).state

    def before_replay(self) -> None:
        where = self._where()
        if where == _ALL_BUFFERS:
            self._attach = None
        elif where == _ALL_NONE:
            self.reset_graph.replay()
            self._attach = self._nones
        else:
            current = list(map(_GRAD, self.params))
            for b, g in zip(self.buffers, current, strict=True):
                if g is None:
                    b.fill_(-0.0)
                elif g is not b:
                    b.copy_(g)
            self._attach = current

    def after_replay(self) -> None:
        if self._attach is None:
            return
        for p, b, g in zip(self.params, self.buffers, self._attach, strict=True):
            if g is None:
                p.grad = b
            elif g is not b:
                g.copy_(b)
        self._attach = None

    def replay_leaving_grads(self, graph) -> None:
        """Replays `graph` for a backward that asks for a subset of the gradients
        (torch.autograd.grad(loss, x), backward(inputs=[x])): eagerly such a backward leaves the
        parameters' .grad alone, so the buffers the graph adds into are put back afterwards (a
        copy of every buffer: the slow path of an unusual call)."""
        saved = [b.clone() for b in self.buffers]
        graph.replay()
        torch._foreach_copy_(self.buffers, saved)


# Gradients of at least this many elements fold into .grad as soon as autograd produces them, so
# that their memory goes back to the pool at once; smaller ones (biases, norm weights) wait for
# one multi-tensor add at the end of the graph: one kernel for all of them, not one each.
FOLD_AT_ONCE = 1 << 16


def check_into_grad(name: str, what: str) -> None:
    """WGRAD_INTO_GRAD is refused, before any state changes, by the captures whose gradients
    come from FSDP2's reduce-scatter instead of a fold the GEMMs could write (FSDP2's layer,
    microbatch and step graphs): the eager backward's GEMM writes .grad rounded once, their
    capture would give today's bits."""
    if into_grad.switched_on():
        raise RuntimeError(
            f"{name}: GRAPHFP8_WGRAD_INTO_GRAD=1 is not supported for {what} (eagerly the "
            "weight-gradient GEMM writes .grad itself, this capture would not, so the graph "
            "would differ from eager): unset it, or capture a model without FSDP2"
        )


class GradFold:
    """Folds each parameter gradient into the parameter's persistent .grad buffer inside the
    backward graph (GradAccumulator says how replays use this).

    Under GRAD_FOLD_COPY_FIRST (graphfp8.ops.switches, read here, at capture) each large
    gradient's first fold in the graph is graphfp8.ops.grad_fold_, which copies when the device
    flag `first` is set and adds when it is not: the accumulator's reset graph sets the flag
    instead of filling those buffers with -0.0, and the backward graph clears it at its end, so
    the first microbatch of a step writes 4 bytes per bf16 element where the fill and the add
    took 6 + 6 (notes/PERF.md, "Gradient accumulation at Llama shapes"). Eager AccumulateGrad
    steals that gradient: the copy is its bits.

    Under WGRAD_INTO_GRAD (read here, at capture) it is also the capture's into_grad Target
    (graphfp8/fp8/into_grad.py): a weight-gradient GEMM writes its parameter's buffer itself,
    with beta read from `alpha_beta[1]` where that is the parameter's first write in the graph
    (1 for later ones): the reset graph sets it to 0 instead of filling those buffers, the
    backward graph back to 1 after its last GEMM, so the buffer is written 2 bytes per bf16
    element per microbatch, with no fill and no add. Autograd gives such a weight no gradient
    (None reaches its hook; another use's gradient still folds, after the GEMM as eagerly)."""

    def __init__(self, params, device):
        # A weight whose gradient a layer adds into its main_grad gets none from autograd.
        self.params = [p for p in params if p.requires_grad and not is_fused(p)]
        self.device = device
        self.buffers = [grad_buffer(p) for p in self.params]
        self.folded: list[int] = []
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.copy_first = env_switch("GRAD_FOLD_COPY_FIRST")
        self.first = torch.zeros(1, dtype=torch.int32, device=device) if self.copy_first else None
        self.flagged: set[int] = set()  # the parameters whose first fold reads `first`
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.alpha_beta = self.beta_zero = self.ones = None
        if into_grad.switched_on() and self.params:
            # Rows (1, 0) and (1, 1), and the (alpha, beta) of each parameter's first GEMM write
            # in the graph (later ones: ones), set by copies: no view op inside a graph.
            table = torch.tensor([[1.0, 0.0], [1.0, 1.0]], device=device)
            self.beta_zero, self.ones = table[0], table[1]
            self.alpha_beta = self.ones.clone()
        self.written: set[int] = set()  # the parameters whose first write is the GEMM's

    def into_grad(self, weight: torch.Tensor, dtype: torch.dtype):
        """into_grad.Target: (the weight's buffer, its (alpha, beta)) for a weight-gradient GEMM
        of `dtype` to write, or None (the GEMM returns dW to autograd, folded as any other)."""
        i = self.index.get(id(weight))
        if self.alpha_beta is None or i is None:
            return None
        if not into_grad.plain(weight, self.buffers[i], dtype):
            return None
        first = i not in self.folded
        self.folded.append(i)
        if first:
            self.written.add(i)
        return self.buffers[i], self.alpha_beta if first else self.ones

    def wrote(self, weight: torch.Tensor) -> bool:
        """into_grad.Target: whether a GEMM of this capture wrote `weight`'s buffer."""
        i = self.index.get(id(weight))
        return i is not None and i in self.written

    def _hook(self, i: int, stand_ins: dict):
        def fold(grad: torch.Tensor | None) -> torch.Tensor | None:
            if grad is None:  # a GEMM wrote the gradient into the buffer (into_grad)
                return None
            if grad.is_cuda and not torch.cuda.is_current_stream_capturing():
                # The add would run now, outside the graph: every replay would miss it.
                raise CaptureError(
                    f"graphfp8 capture: the gradient of a {tuple(grad.shape)} parameter reached "
                    "its accumulation on a stream that is not capturing; its autograd node "
                    "predates the capture (free the outputs of earlier forwards first)"
                )
            first_fold = i not in self.folded
            self.folded.append(i)
            if grad.numel() >= FOLD_AT_ONCE:
                buffer = self.buffers[i]
                if self.copy_first and first_fold and grad.dtype == buffer.dtype:
                    grad_fold_(buffer, grad, self.first)
                    self.flagged.add(i)
                else:  # a second fold in the same graph adds onto the first
                    buffer.add_(grad)
            else:
                self.pending.append((i, grad))
            # autograd.grad returns this zero-byte stand-in instead of the gradient.
            return stand_ins[grad.dtype].expand(grad.shape)

        return fold

    @contextlib.contextmanager
    def hooked(self):
        """Hooks on the parameters for the capture. The CPU tape runs what it records: the
        buffers (some may be a .grad already) are put back as they were afterwards."""
        with host_memory():  # what a GPU would not hold (the CPU accounting: backends.py)
            saved = [b.clone() for b in self.buffers] if self.device.type == "cpu" else None
        stand_ins = {b.dtype: b.new_empty(()) for b in self.buffers}
        handles = [p.register_hook(self._hook(i, stand_ins)) for i, p in enumerate(self.params)]
        routed = into_grad.capturing(self) if self.routes_into_grad else contextlib.nullcontext()
        try:
            with routed:
                yield
        finally:
            for h in handles:
                h.remove()
            self.pending = []
            if saved:
                torch._foreach_copy_(self.buffers, saved)

    def finish(self) -> None:
        """Captures the add of the small gradients, after autograd is done, and the clearing of
        the copy-first flag and the GEMMs' beta back to 1 after every fold and GEMM that reads
        them (on the capture stream, as the rest of the backward graph)."""
        if self.pending:
            idx, grads = zip(*self.pending, strict=True)
            torch._foreach_add_([self.buffers[i] for i in idx], list(grads))
        self.pending = []
        if self.flagged:
            self.first.zero_()
        if self.written:
            self.alpha_beta.copy_(self.ones)

    def check_unused(self, inputs, grads, allow_unused: bool) -> None:
        """torch.autograd.grad's error for a differentiated tensor that got no gradient (the
        capture asks with allow_unused=True while GEMMs write into .grad: their weights get
        None), unless the caller allowed it or a GEMM wrote that gradient. Without the switch
        the capture asked with the caller's allow_unused: nothing to check."""
        if allow_unused or not self.routes_into_grad:
            return
        for i, (t, g) in enumerate(zip(inputs, grads, strict=True)):
            if g is None and not self.wrote(t):
                raise RuntimeError(
                    f"The differentiated Tensor at index {i} appears to not have been used in "
                    "the graph. Set allow_unused=True if this is the desired behavior."
                )

    @property
    def routes_into_grad(self) -> bool:
        """Whether GEMMs may write gradients into the buffers in this capture (autograd then
        gives their weights None)."""
        return self.alpha_beta is not None

    def accumulator(self, pool) -> GradAccumulator | None:
        """The parameters that got a gradient, with a captured fill of their buffers with -0.0
        (fill_minus_zero) but those a flag makes the first fold or GEMM write whole: the reset
        graph sets those flags instead."""
        used = sorted(set(self.folded))
        if not used:
            return None
        params, buffers = [self.params[i] for i in used], [self.buffers[i] for i in used]
        filled = [self.buffers[i] for i in used if i not in self.flagged | self.written]
        with host_memory():
            saved = [b.clone() for b in filled] if self.device.type == "cpu" else None
        reset = new_graph(self.device)
        with reset.capture(pool):
            if self.flagged:
                self.first.fill_(1)
            if self.written:
                self.alpha_beta.copy_(self.beta_zero)
            fill_minus_zero(filled)
        if saved is not None:  # the CPU tape ran what it recorded
            if filled:
                torch._foreach_copy_(filled, saved)
            if self.flagged:
                self.first.zero_()
            if self.written:
                self.alpha_beta.copy_(self.ones)
        keep = ([self.first] if self.flagged else []) + (
            [self.alpha_beta, self.ones, self.beta_zero] if self.written else []
        )
        return GradAccumulator(params, buffers, reset, keep)


def fill_minus_zero(buffers: list[torch.Tensor]) -> None:
    """Every element of `buffers` set to -0.0. By default zero, then negate: two multi-tensor
    kernels over every buffer, 6 bytes per bf16 element (2 written, then 2 read and 2 written).
    Under GRAD_FILL_ONE_PASS (graphfp8.ops.switches, read at capture) each buffer of at least
    FOLD_AT_ONCE elements is one fill_ kernel writing 2 bytes per element; the small ones keep
    the two multi-tensor kernels, one launch each for all of them (docs/benchmarking.md,
    "Kernel switches"; notes/PERF.md, "Gradient accumulation at Llama shapes")."""
    small = buffers
    if env_switch("GRAD_FILL_ONE_PASS"):
        small = [b for b in buffers if b.numel() < FOLD_AT_ONCE]
        for b in buffers:
            if b.numel() >= FOLD_AT_ONCE:
                b.fill_(-0.0)
    if small:
        torch._foreach_zero_(small)
        torch._foreach_neg_(small)


def grad_buffer(param: torch.Tensor) -> torch.Tensor:
    """One persistent .grad buffer per parameter, shared by every callable that uses it."""
    buf = getattr(param, "_graphfp8_grad", None)
    if buf is None:
        buf = torch.zeros_like(param, memory_format=torch.contiguous_format)
        param._graphfp8_grad = buf
    return buf
