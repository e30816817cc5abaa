"""make_graphed_microbatch: one microbatch's forward, loss and backward captured as one graph that
the caller's thread replays without the autograd engine - the middle ground between per-layer
graphs and the step graph, for loops that run their own optimizer (and clipping, and gradient
all-reduce) between optimizer steps.

One call replays, in order: the update of every forward arena, the forward, the loss (divided by
num_microbatches), the backward, the update of every backward arena (each update after its amax
all-reduce over fp8_group), then the fold of the parameter gradients into `.grad` (one captured
multi-tensor copy after zero_grad(set_to_none=True), an add otherwise: AccumulateGrad's
arithmetic). Between calls the caller's thread enqueues only the batch copy (when it passes other
tensors) and, when is_first_microbatch changes value, a fill_ of the weight-cache flag.

A model under torch FSDP2 (fully_shard) is captured with FSDP2's all-gathers, reshards and
reduce-scatters inside the graph; the reduced gradient shards accumulate into the sharded
parameters' .grad (graphs/fsdp.py; docs/sharding.md, "FSDP2 inside the graphs").
"""

from __future__ import annotations

import contextlib

import torch

from graphfp8.fp8.recipe import Recipe
from graphfp8.fp8.weight_cache import DeviceFlag
from graphfp8.graphs.compiled import opaque_to_dynamo
from graphfp8.graphs.fp8_init import fp8_modules_in
from graphfp8.graphs.fsdp import FSDPGrads, FSDPSettings, FSDPSnapshot
from graphfp8.graphs.grads import GradFold, check_into_grad
from graphfp8.graphs.options import CaptureOptions
from graphfp8.graphs.session import CaptureSession
from graphfp8.graphs.step_optim import TrainingSnapshot
from graphfp8.graphs.train_body import StaticBatch, TrainBody
from graphfp8.nvtx_ranges import nvtx_range

__all__ = ["GraphedMicrobatch", "make_graphed_microbatch"]

_NAME = "make_graphed_microbatch"


def make_graphed_microbatch(
    model,
    loss_fn,
    sample_microbatch,
    num_microbatches: int = 1,
    *,
    fp8_enabled: bool = False,
    fp8_recipe: Recipe | None = None,
    fp8_weight_caching: bool = False,
    fp8_group=None,
    num_warmup_iters: int = 3,
    pool=None,
) -> GraphedMicrobatch:
    """Captures forward + loss + backward of one microbatch into one graph.

    `graphed(batch, is_first_microbatch=...)` gives the same bits as this eager code:

        with g8.fp8_autocast(enabled=fp8_enabled, recipe=fp8_recipe, fp8_group=fp8_group):
            out = model(*inputs)  # its FP8 layers get is_first_microbatch
        loss = loss_fn(out, *targets) / num_microbatches
        loss.backward()

    Args:
        model: the nn.Module (every parameter that requires grad gets its gradient in .grad).
        loss_fn: loss_fn(output, *targets) -> 0-d floating-point loss; None: the model's output
            is the loss.
        sample_microbatch: a tensor (the model's only input) or a pair (inputs, targets), each a
            tensor or a tuple of tensors; copies of them become the graph's static batch (the
            caller's tensors are never written).
        num_microbatches: the loss is divided by it before the backward.
        fp8_enabled, fp8_recipe, fp8_group: as for make_graphed_callables.
        fp8_weight_caching: guard the weight casts with a device flag driven by
            is_first_microbatch (True/None cast, False reuses the cache); False by default, as
            for make_graphed_callables (graphs/options.py says why the step differs).
        num_warmup_iters: eager microbatches before capture (at least 1); their effects on
            buffers, FP8 state and RNG are undone.
        pool: a memory pool handle shared with other graphs (CUDA).

    Returns:
        A GraphedMicrobatch; calling it returns loss / num_microbatches (static 0-d device
        tensor, overwritten by the next call).

    .. warning:: A graph replays what its capture ran: the loss is a static buffer, and
        batches, model, mode, FP8 and torch.autocast state stay as captured (outside
        fp8_autocast, with grad enabled, is_first_microbatch=True after every optimizer step);
        gradients are folded into .grad inside the graph, so parameter hooks never run. The
        rules, each checked before anything runs, are in docs/after-capture.md.

    .. warning:: A model under torch FSDP2 (fully_shard at the root; HSDP too) is captured
        with FSDP2's collectives inside the graph, as its hooks ran them at capture: FSDP2's
        settings (reshard_after_forward, gradient sync) stay as captured, checked at every call.
    """
    options = CaptureOptions(_NAME, fp8_enabled, fp8_recipe, fp8_weight_caching, fp8_group,
                             num_warmup_iters, pool, min_warmup=1)  # fmt: skip
    batch = StaticBatch(sample_microbatch, None, _NAME)
    body = TrainBody(model, loss_fn, batch, num_microbatches, _NAME, fsdp2_ok=True)
    device = body.device
    flag = DeviceFlag(device, fp8_enabled, fp8_weight_caching, _NAME, "graphed microbatch")
    if body.fsdp2:
        check_into_grad(_NAME, "an FSDP2 model")
        return _capture_fsdp2(body, options, flag)
    # The snapshot: buffers that the forward updates (batch norm statistics).
    session = CaptureSession(device, options, weight_cache_flag=flag.tensor,
                             snapshot=TrainingSnapshot(model))  # fmt: skip
    with session:
        session.init_fp8([fp8_modules_in([model])])
        with session.warmup() as found:
            for _ in range(num_warmup_iters):
                body.microbatch(None)
        points = session.update_points(session.freeze_arenas(found.arenas))
        graph = session.new_graph()
        fold = GradFold(body.grad_params, device)  # .grad inside the graph (graphs/grads.py)
        with session.capture_phase():
            with fold.hooked(), session.capture_into(graph):
                loss, grads = body.microbatch(None, points)
                fold.finish()
            del grads  # the parameters' stand-ins
            accumulator = fold.accumulator(session.pool)
    guard = body.replay_guard(
        "capture the microbatch again (make_graphed_microbatch)", session.added
    )
    return GraphedMicrobatch(body, graph, accumulator, flag, loss, guard)


def _capture_fsdp2(body: TrainBody, options: CaptureOptions, flag: DeviceFlag):
    """The capture of an FSDP2 model: warmup (FSDP2's lazy init runs in the first) tells which
    sharded parameters get a gradient; the capture runs FSDP2's hooks with each such `.grad` a
    persistent buffer that its reduce-scatter accumulates into (graphs/fsdp.py)."""
    model, device = body.model, body.device
    grads = FSDPGrads(body.params)
    session = CaptureSession(device, options, weight_cache_flag=flag.tensor,
                             snapshot=FSDPSnapshot(model, grads))  # fmt: skip
    with session:
        session.init_fp8([fp8_modules_in([model])])
        grads.save()
        with session.warmup() as found:
            for _ in range(options.num_warmup_iters):
                body.microbatch(None)
            grads.take_warmup(_NAME)
        points = session.update_points(session.freeze_arenas(found.arenas))
        graph = session.new_graph()
        grads.save()
        grads.attach()
        with session.capture_phase():
            with session.capture_into(graph):
                loss, _ = body.microbatch(None, points)
            grads.check_captured(_NAME)
            accumulator = grads.accumulator(device, session.pool)
    guard = body.replay_guard(
        "capture the microbatch again (make_graphed_microbatch)", session.added
    )
    settings = FSDPSettings(_NAME, model)
    return GraphedMicrobatch(body, graph, accumulator, flag, loss, guard, settings, grads.used)


class GraphedMicrobatch:
    """A captured microbatch; see make_graphed_microbatch.

    Attributes:
        loss: 0-d device tensor, the last call's loss / num_microbatches (static).
        params: the parameters that get a gradient, in the model's order.
    """

    def __init__(self, body: TrainBody, graph, accumulator, flag: DeviceFlag, loss, guard,
                 fsdp2: FSDPSettings | None = None, params=None):  # fmt: skip
        self._body, self._graph, self._accumulator, self._flag = body, graph, accumulator, flag
        self._guard, self._fsdp2 = guard, fsdp2
        self._tape = body.device.type == "cpu"
        self.loss = loss
        self.params = body.grad_params if params is None else params

    @opaque_to_dynamo  # one opaque call inside torch.compile'd code, as a graphed callable
    def __call__(self, batch, is_first_microbatch: bool | None = None) -> torch.Tensor:
        """Runs forward, loss and backward of `batch` and accumulates the gradients into
        `.grad`. Returns the loss / num_microbatches (static 0-d device tensor)."""
        body = self._body
        body.check_call()
        if self._fsdp2 is not None:  # first: FSDP2 left gathered swaps the modules' parameters
            self._fsdp2.check()
        self._guard.check()
        given = body.batch.check(batch)
        self._flag.set(is_first_microbatch)
        body.batch.copy(given)
        # The CPU tape re-runs ops in place on leaf tensors and views of them: no grad mode.
        with (
            nvtx_range("replay-microbatch"),
            torch.no_grad() if self._tape else contextlib.nullcontext(),
        ):
            self._accumulator.before_replay()
            self._graph.replay()
            self._accumulator.after_replay()
        self._guard.main_grads.set_added()  # as the eager backward (docs/fp8.md)
        return self.loss

    @property
    def static_batch(self) -> list[torch.Tensor]:
        """The static batch tensors (inputs then targets)."""
        return list(self._body.batch.tensors)

    def captured_ops(self) -> list[str]:
        """The dispatcher ops the capture recorded, in order."""
        return self._graph.op_names

    def captured_kernels(self) -> list[str]:
        """What the graph replays: CUDA kernel nodes on the GPU, tape ops on the CPU."""
        return self._graph.kernels()
