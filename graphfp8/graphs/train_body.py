"""What the step graph and the microbatch graph share: the static batch, the checks on the model
(at capture; the replay guard after it) and one microbatch's scale updates, forward, loss and
backward as warmup and capture run it.

One microbatch, in order (the eager loop with one fp8_autocast region per microbatch runs the
same updates at the same logical points, so both give the same bits):

    update of every forward arena      (eager: at the region's first FP8 use)
    loss = loss_fn(model(*inputs), *targets) / num_microbatches
    grads = torch.autograd.grad(loss, trainable parameters)
    update of every backward arena     (eager: at the end of the backward pass)

An FSDP2 model (make_graphed_microbatch only) runs loss.backward() instead: FSDP2's hooks
reduce-scatter the gradients into the sharded parameters' .grad (graphs/fsdp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.fp8.into_grad import wrote
from graphfp8.fp8.scale_schedule import NONE, UpdatePoints
from graphfp8.graphs.capture_checks import check_capturable, check_grad_mode
from graphfp8.graphs.fsdp import fsdp_hook, is_fsdp2
from graphfp8.graphs.lifecycle import check_outside_fp8_region
from graphfp8.graphs.replay_guard import ReplayGuard, module_names
from graphfp8.graphs.runner import copy_inputs, needs_copy, storages_of
from graphfp8.graphs.torch_autocast import AutocastState

__all__ = ["StaticBatch", "TrainBody", "split_batch"]


def _as_tuple(part, name: str, what: str) -> tuple[torch.Tensor, ...]:
    items = (part,) if isinstance(part, torch.Tensor) else part
    if not isinstance(items, (tuple, list)):
        raise TypeError(f"{name}: the batch's {what} must be a tensor or a tuple of tensors, "
                        f"got {type(part).__name__}")  # fmt: skip
    for t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: the batch's {what} must be tensors, got {type(t).__name__}")
    return tuple(items)


def split_batch(batch, name: str) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(inputs, targets) of a batch: a tensor (the model's only input, no targets) or a pair
    (inputs, targets), each a tensor or a tuple of tensors."""
    if isinstance(batch, torch.Tensor):
        return (batch,), ()
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return _as_tuple(batch[0], name, "inputs"), _as_tuple(batch[1], name, "targets")
    raise TypeError(
        f"{name}: a batch is a tensor or a pair (inputs, targets), each a tensor or a tuple of "
        f"tensors; got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _tensor_text(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


class StaticBatch:
    """The batch tensors a graph reads, and the copy of a caller's batch into them.

    Args:
        sample: the sample batch (see split_batch); a copy of each of its tensors becomes a
            static buffer (replays never write into the caller's tensors; tensors sharing memory
            get buffers of their own).
        leading: the size of dim 0 of every tensor (the microbatch index of a step), or None.
        name: prefix of error messages.
    """

    def __init__(self, sample, leading: int | None, name: str):
        self.name = name
        inputs, targets = split_batch(sample, name)
        self.num_inputs, self.num_targets = len(inputs), len(targets)
        self.tensors = [t.clone() for t in [*inputs, *targets]]
        self.storages = storages_of(self.tensors)
        if not self.tensors:
            raise ValueError(f"{name}: the batch holds no tensor")
        for t in self.tensors:
            if t.requires_grad:
                raise ValueError(
                    f"{name}: batch tensors must not require grad (the graph computes the "
                    "parameters' gradients only)"
                )
            if leading is not None and (t.dim() == 0 or t.shape[0] != leading):
                raise ValueError(
                    f"{name}: every batch tensor holds the {leading} microbatches along dim 0, "
                    f"got {_tensor_text(t)}"
                )
        self.leading = leading
        self.devices = {t.device for t in self.tensors}

    def microbatch(self, i: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(inputs, targets) of microbatch i (views of the static tensors); i=None: all."""
        views = self.tensors if i is None else [t[i] for t in self.tensors]
        return views[: self.num_inputs], views[self.num_inputs :]

    def check(self, batch) -> list[torch.Tensor]:
        """Checks a caller's batch against the captured one; returns its flat tensors."""
        inputs, targets = split_batch(batch, self.name)
        if (len(inputs), len(targets)) != (self.num_inputs, self.num_targets):
            raise ValueError(
                f"{self.name}: captured with {self.num_inputs} input and {self.num_targets} "
                f"target tensors, called with {len(inputs)} and {len(targets)}"
            )
        given = [*inputs, *targets]
        for i, (g, s) in enumerate(zip(given, self.tensors, strict=True)):
            if g is s:  # the static buffer itself (filled in place): nothing to check or copy
                continue
            if g.requires_grad:
                raise ValueError(
                    f"{self.name}: batch tensor {i} requires grad, but the graph computes the "
                    "parameters' gradients only (eager code would give it a .grad); pass it "
                    "detached (t.detach())"
                )
            if g.shape != s.shape or g.dtype != s.dtype or g.device != s.device:
                raise ValueError(
                    f"{self.name}: batch tensor {i} is {_tensor_text(g)}, but the graph was "
                    f"captured for {_tensor_text(s)}; capture another graph for other shapes"
                )
        return given

    def copy(self, given: list[torch.Tensor]) -> None:
        """Copies checked tensors into the static buffers, skipping those that are the buffers
        (copy_inputs: `static_batch` passed at other positions is read before any write)."""
        pairs = [(g, s) for g, s in zip(given, self.tensors, strict=True) if needs_copy(g, s)]
        if pairs:
            copy_inputs(pairs, self.storages)


class TrainBody:
    """A model and its loss, run one microbatch at a time by warmup and capture.

    Args:
        model: the nn.Module; every parameter that requires grad is trained.
        loss_fn: loss_fn(output, *targets) -> 0-d loss; None: the model's output is the loss.
        batch: the static batch.
        num_microbatches: the loss is divided by it before the backward (gradient accumulation).
        name: prefix of error messages.
        fsdp2_ok: the entry point captures FSDP2 models (make_graphed_microbatch).
    """

    def __init__(self, model, loss_fn, batch: StaticBatch, num_microbatches: int, name: str,
                 fsdp2_ok: bool = False):  # fmt: skip
        if not isinstance(model, nn.Module):
            raise TypeError(f"{name}: model must be an nn.Module, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{name}: loss_fn must be callable or None, got {loss_fn!r}")
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise ValueError(f"{name}: num_microbatches must be >= 1, got {num_microbatches!r}")
        self.model, self.loss_fn, self.batch = model, loss_fn, batch
        self.num_microbatches, self.name = num_microbatches, name
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"{name}: the model has no parameter that requires grad")
        devices = batch.devices | {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"{name}: the model and the batch must be on one device, got "
                             f"{sorted(map(str, devices))}")  # fmt: skip
        self.device = devices.pop()
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"{name}: unsupported device {self.device}")
        check_capturable(name, "the model", model, model.modules(), model.named_parameters(),
                         fsdp2_ok=fsdp2_ok)  # fmt: skip
        self.fsdp2 = is_fsdp2(model)
        check_grad_mode(name, True)
        self.training = model.training  # the mode the graph is captured in
        self.autocast = AutocastState(self.device)  # and the torch.autocast state
        self.has_grad: list[bool] | None = None  # which parameters get a gradient (first run)

    # Before every replay ------------------------------------------------------------------------

    def replay_guard(self, recapture: str, added: dict) -> ReplayGuard:
        """The guard of the captured model, checked before every replay (graphs/replay_guard.py);
        added: the weights whose main_grad the capture added into (CaptureSession.added)."""
        names = module_names([("", self.model)])
        return ReplayGuard(self.name, list(self.model.modules()), names, [], recapture,
                           allowed_hook=fsdp_hook if self.fsdp2 else None,
                           added=added)  # fmt: skip

    def check_call(self) -> None:
        """Outside fp8_autocast (the graph carries its own FP8 state), with grad enabled, in the
        captured mode and torch.autocast state."""
        check_outside_fp8_region(self.name)
        if not torch.is_grad_enabled():
            raise RuntimeError(
                f"{self.name}: called under torch.no_grad() or torch.inference_mode(); the graph "
                "trains (a backward into .grad with its FP8 scale update; a step graph also "
                "steps the optimizer), which the eager code cannot do in that mode. Evaluate "
                "eagerly (the model under torch.no_grad()), or call it with grad enabled"
            )
        if self.model.training != self.training:
            mode = "train" if self.training else "eval"
            raise RuntimeError(
                f"{self.name}: captured in {mode} mode, called with model.training="
                f"{self.model.training}; the graph holds the {mode}-mode forward (Dropout, batch "
                "norm statistics). Put the model back in that mode, run other modes eagerly "
                f"(under torch.no_grad() for evaluation), or capture a graph in the other mode"
            )
        self.autocast.check(self.name)

    # One microbatch ----------------------------------------------------------------------------

    def loss(self, i: int | None) -> torch.Tensor:
        """loss_fn(model(*inputs), *targets) / num_microbatches for microbatch i."""
        inputs, targets = self.batch.microbatch(i)
        out = self.model(*inputs)
        loss = out if self.loss_fn is None else self.loss_fn(out, *targets)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()
                and loss.requires_grad):  # fmt: skip
            what = _tensor_text(loss) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(
                f"{self.name}: the loss must be a 0-d floating-point tensor that requires grad, "
                f"got {what}" + (", requires_grad=False" if isinstance(loss, torch.Tensor) else "")
            )
        return loss / self.num_microbatches

    def microbatch(self, i: int | None, points: UpdatePoints = NONE):
        """Runs microbatch i between the capture's two update points (NONE while warming up).

        Returns:
            (loss / num_microbatches, detached 0-d tensor; the gradients of the parameters
            that get one, in parameter order, None for those a weight-gradient GEMM wrote into
            .grad in a capture (fp8/into_grad.py); an FSDP2 model: None, FSDP2 put them in
            .grad).
        """
        points.at_forward()
        loss = self.loss(i)
        if self.fsdp2:
            loss.backward()
            points.at_backward()
            return loss.detach(), None
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        points.at_backward()
        # A weight-gradient GEMM that wrote into .grad in a capture leaves autograd None
        # (graphfp8/fp8/into_grad.py): the weight still gets a gradient.
        has_grad = [g is not None or wrote(p) for p, g in zip(self.params, grads, strict=True)]
        if self.has_grad is None:
            if not any(has_grad):
                raise ValueError(f"{self.name}: no parameter gets a gradient from the loss")
            self.has_grad = has_grad
        elif has_grad != self.has_grad:
            raise RuntimeError(
                f"{self.name}: the set of parameters that get a gradient changed between "
                "microbatches (data-dependent control flow), which a graph cannot hold"
            )
        # One per parameter that gets a gradient: None where a GEMM wrote it into .grad.
        return loss.detach(), [g for g, h in zip(grads, has_grad, strict=True) if h]

    @property
    def grad_params(self) -> list[torch.Tensor]:
        """The parameters that get a gradient, in parameter order (after a first run)."""
        return [p for p, h in zip(self.params, self.has_grad, strict=True) if h]
