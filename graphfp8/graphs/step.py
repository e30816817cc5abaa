"""make_graphed_step: a whole training step captured as one graph that the caller's thread
replays, without the autograd engine - every microbatch's forward, loss and backward, gradient
accumulation, the data-parallel gradient all-reduce, clipping and the optimizer step.

What one replay runs, in order:

    for each microbatch i of the N:
        FP8 weight casts for i == 0 only (the later microbatches reuse them: no cast recorded)
        update of every forward arena          (after the amax MAX all-reduce over fp8_group)
        loss_i = loss_fn(model(*inputs[i]), *targets[i]) / N
        grads = torch.autograd.grad(loss_i, parameters)     (captured once, replayed as kernels)
        update of every backward arena         (after the amax MAX all-reduce over fp8_group)
        .grad = grads (i == 0), .grad += grads (i > 0)       (zero_grad needs no kernel)
        loss += loss_i
    allreduce_gradients(parameters, process_group)          (when given)
    grad_norm = clip_grad_norm_(parameters, max_grad_norm)  (when given)
    optimizer.step()

The capture decides "microbatch 0 casts, the others reuse" (graphfp8/fp8/weight_cache.py's
step_casts): the later microbatches hold no weight-cast node at all, and nothing is written
between replays but the batch (when the caller passes other tensors) and whatever the caller
changes (an LR schedule's fill_ of the learning rate).
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from graphfp8.distributed.gradient_update import GradientUpdate, gradient_update
from graphfp8.fp8.master import MasterWeights
from graphfp8.fp8.recipe import Recipe
from graphfp8.fp8.scale_schedule import NONE, UpdatePoints
from graphfp8.fp8.weight_cache import step_casts
from graphfp8.graphs.compiled import opaque_to_dynamo
from graphfp8.graphs.fp8_init import fp8_modules_in
from graphfp8.graphs.fsdp import check_fsdp_sync
from graphfp8.graphs.grads import check_into_grad
from graphfp8.graphs.options import CaptureOptions
from graphfp8.graphs.session import CaptureSession
from graphfp8.graphs.step_fsdp import FSDPStepBody, FSDPUpdate, check_fsdp2_step
from graphfp8.graphs.step_grads import StepGrads
from graphfp8.graphs.step_optim import OptimizerGuard, TrainingSnapshot, check_optimizer
from graphfp8.graphs.train_body import StaticBatch, TrainBody
from graphfp8.nvtx_ranges import nvtx_range
from graphfp8.ops import GradWatch

__all__ = ["GraphedStep", "make_graphed_step"]

_NAME = "make_graphed_step"


def make_graphed_step(
    model,
    loss_fn,
    optimizer,
    sample_batch,
    num_microbatches: int = 1,
    *,
    fp8_enabled: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_weight_caching: bool = True,
    max_grad_norm: float | None = None,
    fp8_group=None,
    process_group=None,
    num_warmup_iters: int = 3,
    keep_grads_before_clipping: bool = False,
    pool=None,
    master_weights: MasterWeights | None = None,
    fsdp_sync: str = "every",
) -> GraphedStep:
    """Captures one optimizer step over `num_microbatches` microbatches into one graph (a CUDA
    graph on the GPU, a replay tape on the CPU).

    It gives the same bits as this eager loop (one fp8_autocast region per microbatch):

        loss = torch.zeros((), device=device)  # float32
        for i in range(num_microbatches):
            with g8.fp8_autocast(enabled=fp8_enabled, recipe=fp8_recipe, fp8_group=fp8_group):
                out = model(*inputs[i])  # its FP8 layers get is_first_microbatch=(i == 0),
                                         # or None without fp8_weight_caching
            loss_i = loss_fn(out, *targets[i]) / num_microbatches
            loss_i.backward()
            loss += loss_i.detach()
        allreduce_gradients(model.parameters(), process_group)       # if process_group
        grad_norm = clip_grad_norm_(model.parameters(), max_grad_norm)  # if max_grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    Args:
        model: the nn.Module, embedding and head included; every parameter that requires grad
            is trained and must be in the optimizer.
        loss_fn: loss_fn(output, *targets) -> 0-d floating-point loss; None: the model's
            output is the loss.
        optimizer: torch.optim.Adam or AdamW with capturable=True (on the CPU: fused=True), or
            torch.optim.SGD with fused=True (with momentum: its buffers must exist). Float
            learning rates become float32 device tensors, in place: update them with
            `group["lr"].fill_(lr)` (torch's LR schedulers do) between replays.
        sample_batch: a tensor (the model's only input) or a pair (inputs, targets), each a
            tensor or a tuple of tensors, every tensor of shape (num_microbatches, ...):
            microbatch i is `t[i]`. Copies of them become the graph's static batch (the caller's
            tensors are never written).
        num_microbatches: N, the gradient-accumulation steps per optimizer step.
        fp8_enabled: run graphfp8 modules in FP8.
        fp8_recipe: a DelayedScaling or Float8CurrentScaling (DelayedScaling() when None).
        fp8_weight_caching: cast the FP8 weights on microbatch 0 only (False: every microbatch);
            True by default, unlike the other entry points: the graph knows which microbatch is
            first (graphs/options.py).
        max_grad_norm: clip the gradients to this global L2 norm; None: no clipping.
        fp8_group: torch.distributed group whose ranks MAX-reduce amaxes with every scale update.
        process_group: torch.distributed group over which gradients are averaged once per step
            (distributed.allreduce_gradients, captured); None: no gradient all-reduce.
        num_warmup_iters: eager steps before capture (at least 1); their effects on parameters,
            buffers, optimizer state, FP8 state and RNG are undone.
        keep_grads_before_clipping: also keep a copy of the accumulated (all-reduced) gradients
            before clipping in `grads_before_clipping` (one extra copy per step).
        pool: a memory pool handle shared with other graphs (CUDA).
        master_weights: the graphfp8.MasterWeights of a model with FP8 primary weights
            (fp8_model_init); the optimizer then holds master_weights.parameters(), and the
            graph runs master_weights.step(optimizer) in place of optimizer.step() (the
            weights' transposes are rebuilt on the next replay's microbatch 0). Sharded
            masters (MasterWeights(model, shard_group=group)) put the whole sharded step in the
            graph: their reduce-scatter replaces the all-reduce (process_group must be None),
            max_grad_norm clips by the global norm (masters.clip_grad_norm_), and the FP8 and
            high-precision all-gathers follow the optimizer (docs/sharding.md).
        fsdp_sync: a model under torch FSDP2: "every" microbatch reduce-scatters its gradients
            (FSDP2's default), or only the "last": microbatches 0..N-2 run with
            model.set_requires_gradient_sync(False) and set_reshard_after_backward(False) (the
            eager loop does the same, i == N - 1 on the last), accumulating the unsharded
            gradients with the weights left gathered - one reduce-scatter per step (and with
            reshard_after_forward=False one all-gather), other summation order, more memory
            (docs/sharding.md, "Gradient accumulation without communication").

    Returns:
        A GraphedStep: `step(batch)` replays the graph and returns the loss (0-d float32 device
        tensor, the sum of loss_i; reading it is the only host sync).

    .. warning:: A graph replays what its capture ran: the loss, grad_norm and .grad buffers
        are static, and batches, model, mode, optimizer, FP8 and torch.autocast state stay as
        captured (outside fp8_autocast, with grad enabled; tensor learning rates change with
        fill_); warmup and capture undo their steps from a host copy of the parameters, buffers
        and optimizer state, dropped after capture (docs/sharding.md, "Memory planner"). The
        rules, each checked before anything runs, are in docs/after-capture.md.

    .. warning:: A model under torch FSDP2 (fully_shard at the root; HSDP too) is captured with
        FSDP2's all-gathers and reduce-scatters inside the graph (its backward is
        loss.backward(), so FSDP2's post-backward runs; graphs/step_fsdp.py): process_group
        must be None, master_weights is graphfp8.MasterWeights(model) when it has FP8 weights,
        the clip is clip_grad_norm_(model.parameters()) over the DTensor shards, and FSDP2's
        settings stay as captured, checked at every call (docs/sharding.md).
    """
    options = CaptureOptions(_NAME, fp8_enabled, fp8_recipe, fp8_weight_caching, fp8_group,
                             num_warmup_iters, pool, min_warmup=1)  # fmt: skip
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"{_NAME}: max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    batch = StaticBatch(sample_batch, num_microbatches, _NAME)
    body = TrainBody(model, loss_fn, batch, num_microbatches, _NAME, fsdp2_ok=True)
    check_fsdp_sync(_NAME, model, fsdp_sync, body.fsdp2)
    if body.fsdp2:
        check_into_grad(_NAME, "an FSDP2 model")  # graphs/grads.py
        check_fsdp2_step(_NAME, process_group, master_weights, keep_grads_before_clipping)
        return _capture_fsdp2(body, options, optimizer, max_grad_norm, master_weights,
                              fsdp_sync)  # fmt: skip
    # body.grad_params: the parameters that get a gradient, known after the first microbatch.
    update = gradient_update(lambda: body.grad_params, process_group, master_weights, name=_NAME,
                             keep_grads=keep_grads_before_clipping)  # fmt: skip
    check_optimizer(_NAME, optimizer, update.optimizer_params(body.params, _NAME), body.device)
    snapshot = TrainingSnapshot(model, optimizer, update.tensors())
    session = CaptureSession(body.device, options, snapshot=snapshot)
    run = StepBody(body, optimizer, max_grad_norm, update, keep_grads_before_clipping,
                   options.caching, session)  # fmt: skip
    graph, loss, grad_norm = _capture(run, session, body, model)
    guard = body.replay_guard("capture the step again (make_graphed_step)", session.added)
    return GraphedStep(run, graph, guard, OptimizerGuard(_NAME, optimizer), loss, grad_norm)


def _capture(run, session: CaptureSession, body: TrainBody, model: torch.nn.Module) -> tuple:
    """(graph, loss, grad_norm) of `run` warmed up and captured in `session`; a failure gives the
    parameters their gradients back before it propagates."""
    old_grads = [p.grad for p in body.params]
    try:
        with session:
            session.init_fp8([fp8_modules_in([model])])
            return _warmup_and_capture(run, session)
    except BaseException:
        for p, g in zip(body.params, old_grads, strict=True):
            p.grad = g
        raise


def _capture_fsdp2(body: TrainBody, options: CaptureOptions, optimizer, max_grad_norm,
                   masters, sync: str) -> GraphedStep:  # fmt: skip
    """The step graph of an FSDP2 model (graphs/step_fsdp.py): warmup finds the shards that get
    a gradient; the capture runs FSDP2's hooks with each such .grad a persistent buffer."""
    update = FSDPUpdate(body.params, masters)
    check_optimizer(_NAME, optimizer, update.optimizer_params(body.params, _NAME), body.device)
    snapshot = TrainingSnapshot(body.model, optimizer, update.tensors())
    session = CaptureSession(body.device, options, snapshot=snapshot)
    run = FSDPStepBody(body, optimizer, max_grad_norm, update, options.caching, session, sync)
    graph, loss, grad_norm = _capture(run, session, body, body.model)
    guard = body.replay_guard("capture the step again (make_graphed_step)", session.added)
    params, grads = run.static_grads()
    return GraphedStep(run, graph, guard, OptimizerGuard(_NAME, optimizer), loss, grad_norm,
                       (params, grads, run.settings()))  # fmt: skip


def _warmup_and_capture(run, session: CaptureSession):
    with warnings.catch_warnings():
        # Eager steps of a capturable optimizer make torch warn that capturable costs speed.
        warnings.filterwarnings("ignore", message="This instance was constructed with capt")
        with session.warmup() as found:
            for _ in range(session.options.num_warmup_iters):
                run(NONE)
    points = session.update_points(session.freeze_arenas(found.arenas))
    graph = session.new_graph()
    if isinstance(run, FSDPStepBody):
        run.prepare_capture()
        routing = contextlib.nullcontext()
    else:  # WGRAD_INTO_GRAD's GEMMs write the static .grad buffers (graphs/step_grads.py)
        routing = run.into_grads()
    with session.capture_phase(), session.capture_into(graph), routing:
        loss, grad_norm = run(points)
    return graph, loss, grad_norm


class StepBody:
    """One optimizer step (the microbatches of a TrainBody, the gradient all-reduce, clipping,
    the optimizer) as warmup runs it and capture records it."""

    def __init__(self, body: TrainBody, optimizer, max_grad_norm, update: GradientUpdate,
                 keep: bool, caching: bool, session: CaptureSession):  # fmt: skip
        self.body, self.optimizer, self.update = body, optimizer, update
        self.max_grad_norm, self.keep = max_grad_norm, keep
        self.session = session
        # Microbatch 0 records the weight casts, the others record none (they reuse its casts).
        self.weight_casts = step_casts(body.num_microbatches, caching)
        self.grads: list[torch.Tensor] | None = None
        self.grads_before_clipping: list[torch.Tensor] | None = None
        self.folds: StepGrads | None = None

    def __call__(self, points: UpdatePoints):
        """Runs the step between the update points of each microbatch (NONE while warming up);
        returns (loss, grad_norm or None)."""
        body = self.body
        total = torch.zeros((), dtype=torch.float32, device=body.device)
        for i in range(body.num_microbatches):
            with self.session.weight_policy(self.weight_casts[i]):
                loss, grads = body.microbatch(i, points)
            self._accumulate(i, grads)
            total += loss
            del loss, grads  # microbatch i's memory is free for microbatch i + 1
        # reduce -> clip -> step -> write back (distributed/gradient_update.py)
        self.update.reduce_grads_()
        if self.keep:
            torch._foreach_copy_(self.grads_before_clipping, self.grads)
        grad_norm = None
        if self.max_grad_norm is not None:
            grad_norm = self.update.clip_grad_norm_(self.max_grad_norm)
        self.update.step(self.optimizer)
        return total, grad_norm

    def into_grads(self):
        """The capture's block in which the weight-gradient GEMMs may write the static .grad
        buffers (GRAPHFP8_WGRAD_INTO_GRAD), a fresh fold of the buffers."""
        self.folds = StepGrads(self.body.grad_params, self.grads)
        return self.folds.routing()

    def _accumulate(self, i: int, grads: list[torch.Tensor | None]) -> None:
        if self.grads is None:  # the first warmup microbatch: persistent .grad buffers
            params = self.body.grad_params
            self.grads = [torch.zeros_like(p) for p in params]
            for p, has_grad in zip(self.body.params, self.body.has_grad, strict=True):
                if not has_grad:
                    p.grad = None  # the optimizer skips it, as after zero_grad(set_to_none)
            for p, g in zip(params, self.grads, strict=True):
                p.grad = g
            if self.keep:
                self.grads_before_clipping = [torch.zeros_like(g) for g in self.grads]
            self.folds = StepGrads(self.body.grad_params, self.grads)
        # AccumulateGrad's arithmetic: the first gradient as is, then in-place adds.
        self.folds.accumulate(i, grads)


class GraphedStep:
    """A captured training step. Call it with a batch; see make_graphed_step.

    Attributes:
        loss: 0-d float32 device tensor, the last step's loss (static).
        grad_norm: 0-d device tensor, the last step's gradient norm before clipping (static), or
            None without max_grad_norm.
        params: the parameters that get a gradient, in the model's order.
        grads: their `.grad` buffers (static): what the optimizer applied in the last step; a
            call puts them back as `.grad` after zero_grad(set_to_none=True) or a replaced
            `.grad`.
        grads_before_clipping: copies of `grads` before clipping (keep_grads_before_clipping).
    """

    def __init__(self, run: StepBody | FSDPStepBody, graph, guard,
                 optimizer_guard: OptimizerGuard, loss, grad_norm, fsdp2=None):  # fmt: skip
        self._run, self._graph = run, graph
        self._guard, self._optimizer_guard = guard, optimizer_guard
        self._body = run.body
        self._tape = run.body.device.type == "cpu"
        self.loss, self.grad_norm = loss, grad_norm
        self._fsdp2 = None
        if fsdp2 is None:
            self.params = run.body.grad_params
            self.grads, self.grads_before_clipping = run.grads, run.grads_before_clipping
        else:  # (params, their static .grad, FSDPSettings): graphs/step_fsdp.py
            self.params, self.grads, self._fsdp2 = fsdp2
            self.grads_before_clipping = None
        # Where the parameters' .grad stand, in one C++ pass (graphs/grads.py).
        self._grads_attached = GradWatch(self.params, self.grads).state

    @opaque_to_dynamo  # one opaque call inside torch.compile'd code, as a graphed callable
    def __call__(self, batch) -> torch.Tensor:
        """Runs one optimizer step on `batch` (same structure as the sample batch). Returns the
        loss (static 0-d float32 device tensor)."""
        self._body.check_call()
        if self._fsdp2 is not None:  # first: FSDP2 left gathered swaps the modules' parameters
            self._fsdp2.check()
        self._guard.check()
        self._optimizer_guard.check()
        given = self._body.batch.check(batch)
        self._body.batch.copy(given)
        if self._grads_attached() != 0:
            # zero_grad(set_to_none=True) or a .grad replaced since the last step: the graph
            # writes its own buffers, so after this step .grad shows them again, not a stale
            # tensor (what eager code leaves in .grad after backward is this step's gradient).
            for p, g in zip(self.params, self.grads, strict=True):
                p.grad = g
        with nvtx_range("replay-step"):
            self.launch_only()
        self._guard.main_grads.set_added()  # as the eager backward (docs/fp8.md)
        return self.loss

    def launch_only(self) -> None:
        """Replays the step on the static batch without the per-call checks or the batch copy:
        what the launch alone costs the host (`python -m benchmarks step`). Training calls
        the step itself."""
        # The CPU tape re-runs ops in place on leaf tensors and views of them: no grad mode.
        with torch.no_grad() if self._tape else contextlib.nullcontext():
            self._graph.replay()

    @property
    def static_batch(self):
        """The static batch tensors (inputs then targets): fill them in place and pass them to
        skip the copy."""
        return list(self._body.batch.tensors)

    def captured_ops(self) -> list[str]:
        """The dispatcher ops the capture recorded, in order."""
        return self._graph.op_names

    def captured_kernels(self) -> list[str]:
        """What the graph replays: CUDA kernel nodes on the GPU, tape ops on the CPU."""
        return self._graph.kernels()

    def captured_nodes(self) -> list[tuple[str, str]]:
        """(node type, name) of what the graph replays: ("KERNEL", name), ("MEMSET", ""), ...
        on the GPU, ("OP", name) for each tape op on the CPU."""
        return self._graph.nodes()
