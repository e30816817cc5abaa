"""make_graphed_step of a model under torch FSDP2 (fully_shard): the whole step in one graph -
every microbatch's forward and backward with FSDP2's all-gathers, reshards and reduce-scatters,
the clip by the global norm over the DTensor shards, the optimizer on the shards and, with
FSDPMasterWeights, the FP8 weights' write-back with its one amax all-reduce (docs/sharding.md,
"FSDP2 inside the step graph").

The backward is `loss.backward()`, not torch.autograd.grad: FSDP2's post-backward (its
reduce-scatter into each sharded `.grad`) runs from its autograd hooks, which only a backward
into the leaves fires. What one replay runs, in order:

    for each microbatch i: forward (FSDP2's all-gathers), loss_i, loss_i.backward()
        (FSDP2's first reduce-scatter of a shard writes its output, which the capture left as
        the parameter's .grad - the step's static gradient - and later ones add into it;
        fsdp_sync="last": microbatches 0..N-2 run with FSDP2's gradient sync and reshard after
        backward off - no reduce-scatter, the unsharded gradients accumulated by autograd, the
        weights left gathered - and the last one reduce-scatters their sum)
    grad_norm = clip_grad_norm_(model.parameters(), max_grad_norm)  (when given; DTensor's norm)
    masters.step(optimizer) or optimizer.step()             (FP8 weights: one amax all-reduce)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from graphfp8.distributed.fsdp_masters import FSDPMasterWeights
from graphfp8.fp8.master import TENSOR_GRAD
from graphfp8.fp8.scale_schedule import NONE, UpdatePoints
from graphfp8.fp8.tensor import is_fsdp_fp8
from graphfp8.fp8.weight_cache import step_casts
from graphfp8.graphs.fsdp import SYNC_SETTINGS, FSDPGrads, FSDPSettings, set_fsdp_sync
from graphfp8.graphs.session import CaptureSession
from graphfp8.graphs.train_body import TrainBody

__all__ = ["FSDPStepBody", "FSDPUpdate", "check_fsdp2_step"]


def check_fsdp2_step(name: str, process_group, master_weights, keep_grads: bool) -> None:
    """Raises, naming the fix, for the step-graph options an FSDP2 model cannot take."""
    if process_group is not None:
        raise ValueError(
            f"{name}: the model is under FSDP2, whose reduce-scatters average the gradients "
            "over its mesh in the backward; an all-reduce over process_group would reduce "
            "them twice. Pass process_group=None"
        )
    if master_weights is not None and not isinstance(master_weights, FSDPMasterWeights):
        raise ValueError(
            f"{name}: the model is under FSDP2; its FP8 weights' masters are "
            f"graphfp8.MasterWeights(model) (FSDPMasterWeights), got "
            f"{type(master_weights).__name__}"
        )
    if keep_grads:
        raise ValueError(
            f"{name}: keep_grads_before_clipping is not supported for an FSDP2 model (its "
            "reduced gradients are this rank's shards); read the shards' .grad after the step"
        )


class FSDPUpdate:
    """The GradientUpdate (distributed/gradient_update.py) of an FSDP2 model: FSDP2 reduced the
    gradients in the backward; the clip is by the global norm over the model's DTensor shards;
    the step goes through FSDPMasterWeights when the model has FP8 weights.

    Args:
        params: the model's trainable parameters (DTensors).
        masters: the model's FSDPMasterWeights, or None.
    """

    def __init__(self, params: list[torch.Tensor], masters: FSDPMasterWeights | None) -> None:
        self.params, self.masters = params, masters

    def optimizer_params(self, model_params: list[torch.Tensor], name: str) -> list:
        fp8 = [p for p in model_params if is_fsdp_fp8(p)]
        if self.masters is None:
            if fp8:
                raise ValueError(
                    f"{name}: a model with FP8 primary weights (fp8_model_init) needs "
                    "master_weights=graphfp8.MasterWeights(model) and an optimizer over "
                    "master_weights.parameters()"
                )
            return list(model_params)
        return self.masters.parameters()

    def tensors(self) -> list[torch.Tensor]:
        return self.masters.tensors() if self.masters is not None else []

    def reduce_grads_(self) -> None:
        """Nothing: FSDP2's reduce-scatters ran in each microbatch's backward."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_(model.parameters()), as the unsharded step graph and
        graphfp8-train's eager FSDP2 step clip: the FP8 weights' gradient shards in their
        nominal dtype, before the masters take them in. Returns the norm (0-d, every rank's)."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.masters is not None:
            self.masters.step(optimizer)
        else:
            optimizer.step()

    def clear_master_grads(self) -> None:
        """The masters' fp32 .grad set to None (no kernel), leaving the FP8 weights' .grad: the
        step's first read of a master's .grad then copies its weight's reduced shard into a
        fresh tensor (the graph's static master gradient) instead of adding to the last one."""
        for m in self.masters.masters if self.masters is not None else ():
            TENSOR_GRAD.__set__(m, None)


class FSDPStepBody:
    """One FSDP2 optimizer step as warmup runs it and capture records it (module docstring).

    Args:
        body: the model, loss and batch.
        optimizer: the torch optimizer over update.optimizer_params.
        max_grad_norm: the clip's global L2 norm, or None.
        update: the model's FSDPUpdate.
        caching: the step's weight-cache policy (graphs/options.py).
        session: the capture session.
        sync: fsdp_sync, "every" or "last" (graphs/fsdp.py's FSDP_SYNCS).
    """

    def __init__(self, body: TrainBody, optimizer, max_grad_norm, update: FSDPUpdate,
                 caching: bool, session: CaptureSession, sync: str = "every"):  # fmt: skip
        self.body, self.optimizer, self.update = body, optimizer, update
        self.max_grad_norm, self.session, self.sync = max_grad_norm, session, sync
        self.weight_casts = step_casts(body.num_microbatches, caching)
        self.grads = FSDPGrads(body.params)
        self.capturing = False

    def __call__(self, points: UpdatePoints = NONE):
        """Runs the step (NONE: a warmup step); returns (loss, grad_norm or None)."""
        body, grads = self.body, self.grads
        total = torch.zeros((), dtype=torch.float32, device=body.device)
        # The step starts as after zero_grad(set_to_none=True): FSDP2's first reduce-scatter of
        # each shard assigns its .grad (captured: a view of its reduce-scatter output that every
        # replay writes again, the step's static gradient; no fill, no add).
        for p in body.params:
            p.grad = None
        self.update.clear_master_grads()
        last = body.num_microbatches - 1
        try:
            for i in range(body.num_microbatches):
                if self.sync == "last":
                    set_fsdp_sync(body.model, i == last)
                with self.session.weight_policy(self.weight_casts[i]):
                    loss, _ = body.microbatch(i, points)
                total += loss
                del loss
        finally:  # FSDP2's defaults again, also when a microbatch raised (check_fsdp_sync)
            if self.sync == "last":
                set_fsdp_sync(body.model, True)
        if self.capturing:
            grads.take_assigned(body.name)
        elif not grads.used:  # the first warmup step: which shards get a gradient
            grads.take_warmup(body.name)
        grad_norm = None
        if self.max_grad_norm is not None:
            grad_norm = self.update.clip_grad_norm_(self.max_grad_norm)
        self.update.step(self.optimizer)
        return total, grad_norm

    def prepare_capture(self) -> None:
        """Before capture: the step then takes the .grad FSDP2 assigns as its static ones."""
        self.capturing = True

    def static_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """After capture: (parameters, the gradient buffers the graph writes) of what .grad
        shows after a step - each FP8 weight's fp32 master (its weight's shard moved in) and
        every other parameter that gets a gradient."""
        masters = self.update.masters
        by_weight = {} if masters is None else dict(
            zip(map(id, masters.fp8_params), masters.masters, strict=True))  # fmt: skip
        params, buffers = [], []
        for p, b in zip(self.grads.used, self.grads.buffers, strict=True):
            m = by_weight.get(id(p))
            params.append(p if m is None else m)
            buffers.append(b if m is None else TENSOR_GRAD.__get__(m))
        return params, buffers

    def settings(self) -> FSDPSettings:
        """FSDP2's settings as captured, checked before every replay."""
        graph_sets = SYNC_SETTINGS if self.sync == "last" else ()
        return FSDPSettings(self.body.name, self.body.model, graph_sets)
