"""MasterWeights: fp32 master copies of a model's FP8 primary weights, for a torch optimizer.

    masters = g8.MasterWeights(model)                  # model built inside fp8_model_init
    opt = torch.optim.AdamW(masters.parameters(), ...)  # fp32 masters + the model's other params
    ... forward / backward (is_first_microbatch=True on each step's first microbatch) ...
    torch.nn.utils.clip_grad_norm_(masters.parameters(), 1.0)   # optional: the joint norm
    masters.step(opt)        # grads -> masters, opt.step(), masters -> FP8 weights (one cast each)
    masters.zero_grad()

A master's `.grad` is its FP8 weight's gradient in fp32: reading it (the optimizer, clipping,
an all-reduce, your own code) first moves the FP8 weight's pending `.grad` into it (added to what
it holds; the FP8 weight's `.grad` becomes None), so everything that reads the masters' grads
sees every gradient, whenever it runs. Clipping `model.parameters()` before `masters.step()`
works too (the FP8 weights' grads are clipped in place, then moved). Inside a step graph
(make_graphed_step(master_weights=...)) the graph copies the grads itself: there `.grad` of a
master is the graph's buffer, read as it is.

The masters are a tensor subclass (for that `.grad`), so torch's optimizers step them with their
for-loop implementation by default (they pick foreach only for plain tensors, on CUDA): a
high-precision model compared bit for bit needs the same implementation (`foreach=False` on its
optimizer; the two round 1 ulp apart, H200 2026-12-01). Whether `foreach=True` takes the
subclass is not tested.

The write-back quantizes each master with its own amax (graphfp8.fp8.primary.WeightQuantizer;
a blockwise weight, each 128x128 block with its own: BlockWeightQuantizer) and marks the
weight's transpose cache stale; the next forward with is_first_microbatch=True (or
None) rebuilds it, in a graph as the captured transpose node. Every step is device work only.

This class is the unsharded kind. `graphfp8.MasterWeights(model, ...)` builds the kind a model
needs (graphfp8.distributed.masters): this one, ShardedMasterWeights (shard_group=: every
trainable parameter's master, gradient and optimizer state split over the group's ranks) or
FSDPMasterWeights (a model under torch FSDP2), docs/sharding.md.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from graphfp8.fp8 import context
from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.primary import quantize_weight, quantizer_for
from graphfp8.fp8.tensor import Float8Tensor, is_fsdp_fp8
from graphfp8.ops.blockwise import quantize_blocks

__all__ = ["TENSOR_GRAD", "MasterWeights"]

TENSOR_GRAD = torch._C.TensorBase.grad  # the C-level .grad slot, under _Master's property


def capturing() -> bool:
    """Whether a graph capture (or its warmup) is running: the one read of the FP8 context by
    the masters (unsharded and sharded)."""
    return context.current().capturing


class _Mode:
    """Shared by the masters of one MasterWeights: whether a step graph captured its step."""

    def __init__(self) -> None:
        self.in_graph = False

    def moves(self) -> bool:
        """Whether reading a master's .grad moves its FP8 weight's pending grad in (eagerly);
        a capture or a step graph copies the grads itself, into buffers that must stay."""
        return not self.in_graph and not capturing()


class _Master(torch.Tensor):
    """An fp32 master: a plain tensor whose `.grad` first takes in its FP8 weight's pending
    gradient (module docstring). Ops on it return plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _weight: Float8Tensor
    _mode: _Mode

    @property
    def grad(self):
        if self._mode.moves() and self._weight.grad is not None:
            with torch.no_grad():
                pending, held = self._weight.grad, TENSOR_GRAD.__get__(self)
                if held is None:
                    TENSOR_GRAD.__set__(self, pending.to(torch.float32, copy=True))
                else:
                    held.add_(pending)
                self._weight.grad = None
        return TENSOR_GRAD.__get__(self)

    @grad.setter
    def grad(self, value) -> None:
        if self._mode.moves():  # the pending gradient belongs to the old value
            self._weight.grad = None
        TENSOR_GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    def __deepcopy__(self, memo) -> _Master:
        new = _master(self.detach().clone(), copy.deepcopy(self._weight, memo), self._mode)
        grad = TENSOR_GRAD.__get__(self)
        if grad is not None:
            TENSOR_GRAD.__set__(new, grad.clone())
        memo[id(self)] = new
        return new


# {FP8 weight: weakref to the _Mode of the MasterWeights that trains it} (kept off the tensor,
# which torch.save(model) would pickle with its attributes).
_CLAIMS = WeakIdKeyDictionary()


def claim(names: list[str], weights: list[torch.Tensor], mode) -> None:
    """Marks each weight as trained through `mode`'s masters (any object the MasterWeights
    keeps alive); a weight whose earlier MasterWeights is still alive (its masters in an
    optimizer) raises: reading one set's grads would take the gradient from the other."""
    taken = [n for n, w in zip(names, weights, strict=True)
             if _CLAIMS.get(w, lambda: None)() is not None]  # fmt: skip
    if taken:
        raise ValueError(
            f"MasterWeights: {taken} already have fp32 masters (another MasterWeights whose "
            "masters are alive, e.g. in an optimizer): use that one, or drop it first"
        )
    for w in weights:
        _CLAIMS[w] = weakref.ref(mode)


def _master(value: torch.Tensor, weight: Float8Tensor, mode: _Mode) -> _Master:
    """value (fp32) as the master of `weight`."""
    m = torch.Tensor._make_subclass(_Master, value, weight.requires_grad)
    m._weight, m._mode = weight, mode
    return m


def _is_fp8(p: torch.Tensor) -> bool:
    """An FP8 weight, or an FSDP2 shard of one."""
    return isinstance(p, Float8Tensor) or is_fsdp_fp8(p)


class ClaimAnchor:
    """What the claims on the weights of sharded or FSDP2 masters point at (weakly): alive as
    long as those masters."""


def _versions(weights: list[Float8Tensor]) -> list[tuple[int, int, int]]:
    """Each weight's version counters: its own (copy_ into it: load_state_dict, a capture's
    restore; ops inside its __torch_dispatch__ move no inner counter) and its data's and
    scales' (written directly)."""
    return [(p._version, p._data._version, p._scale_inv._version) for p in weights]


def _holds(weight: Float8Tensor, master: torch.Tensor) -> bool:
    """Whether `weight` holds exactly what a write-back of `master` writes (data and scales)."""
    if isinstance(weight, Float8BlockTensor):
        data, scale_inv = quantize_blocks(master.detach(), weight.fp8_dtype,
                                          weight._power_2_scale)  # fmt: skip
    else:
        fresh = quantize_weight(master.detach(), weight.fp8_dtype)
        data, scale_inv = fresh._data, fresh._scale_inv
    return torch.equal(data.view(torch.uint8), weight._data.view(torch.uint8)) and torch.equal(
        scale_inv, weight._scale_inv
    )


def check_fp8_weights_kept(model: nn.Module, what: str) -> None:
    """Raises if a graphfp8 layer built inside fp8_model_init holds a GEMM weight (a 2-D
    parameter of the layer itself) that is no longer FP8: something replaced it with a
    high-precision copy, which these masters would train as such (torch FSDP2's sharding did,
    before graphfp8.fp8.tensor_fsdp; its CPU offload still copies)."""
    lost = [f"{mod + '.' if mod else ''}{name} ({p.dtype})"
            for mod, m in model.named_modules() if getattr(m, "_fp8_primary", False)
            for name, p in m.named_parameters(recurse=False)
            if p.dim() >= 2 and not _is_fp8(p)]  # fmt: skip
    if lost:
        raise ValueError(
            f"{what}: the model was built with FP8 primary weights (fp8_model_init), but {lost} "
            "are now high-precision tensors: something replaced them (an assignment, or a torch "
            "FSDP2 option that copies parameters, such as CPU offload; plain fully_shard keeps "
            "them FP8, docs/sharding.md)"
        )


def clear_grads(tensors, set_to_none: bool) -> None:
    """Sets each tensor's .grad to None, or zeroes it in place."""
    for t in tensors:
        if t.grad is None:
            continue
        if set_to_none:
            t.grad = None
        else:
            t.grad.zero_()


class MasterWeights:
    """fp32 masters of every FP8 primary weight of `model`; other parameters are used as they are
    (unsharded; graphfp8.MasterWeights builds the kind a model needs, distributed/masters.py).

    Args:
        model: a module with FP8 primary weights (created inside graphfp8.fp8_model_init).
    """

    def __init__(self, model: nn.Module) -> None:
        check_fp8_weights_kept(model, "MasterWeights")
        named = list(model.named_parameters())
        self.names = [n for n, p in named if isinstance(p, Float8Tensor)]
        self.fp8_params = [p for _, p in named if isinstance(p, Float8Tensor)]
        if not self.fp8_params:
            raise ValueError(
                "MasterWeights: the model has no FP8 primary weights; create its graphfp8 layers "
                "inside graphfp8.fp8_model_init()"
            )
        self.others = [p for _, p in named if not isinstance(p, Float8Tensor)]
        self._mode = _Mode()
        claim(self.names, self.fp8_params, self._mode)
        self._checked_optimizer = None  # weakref to the optimizer step() last checked
        self.masters = [
            _master(p.dequantize(torch.float32), p, self._mode) for p in self.fp8_params
        ]
        self.quantizers = [quantizer_for(p) for p in self.fp8_params]
        # From here on every FP8 weight is exactly its master quantized: the same bits as the
        # forward's own weight cast of a high-precision model holding the masters would give.
        self.write_back_()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor that step() changes besides the model's and the optimizer's: the masters
        and the quantizers' scales (a graph capture snapshots and restores them)."""
        return [*self.masters, *(t for q in self.quantizers for t in q.tensors())]

    def master_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """(the fp32 masters, the gradients they hold now), as the memory report counts them."""
        return list(self.masters), [TENSOR_GRAD.__get__(m) for m in self.masters]

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer updates: the fp32 masters, then the model's other parameters."""
        return [*self.masters, *self.others]

    @torch.no_grad()
    def copy_grads_(self) -> None:
        """Each FP8 weight's .grad (its nominal dtype) into its master's fp32 .grad: moved in,
        as reading the master's .grad does; inside a capture (a step graph), copied into the
        master's persistent .grad (None stays None)."""
        if self._mode.moves():
            for m in self.masters:
                m.grad  # noqa: B018 - the property moves the pending gradient in
            return
        for p, m in zip(self.fp8_params, self.masters, strict=True):
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = p.grad.to(torch.float32, copy=True)
            else:
                m.grad.copy_(p.grad)

    @torch.no_grad()
    def write_back_(self) -> None:
        """Quantizes every master into its FP8 weight (data and scale_inv; transpose stale)."""
        for p, m, q in zip(self.fp8_params, self.masters, self.quantizers, strict=True):
            q.quantize_(m, p)
        self._written = _versions(self.fp8_params)

    @torch.no_grad()
    def adopt_changes_(self) -> None:
        """Reseeds, from its FP8 weight (dequantized, as construction seeds it), each master
        whose weight no longer holds the master's quantization: a model.load_state_dict after
        building the masters, which the next write-back would silently undo (the sharded
        masters adopt them too: graphfp8.distributed.sharded_guard). Looked at only where the
        weight's version moved since the last write-back (a capture's restore of the same bytes
        moves it too); eager only: a graph replay steps the masters it captured."""
        if capturing() or self._mode.in_graph:
            return
        now = _versions(self.fp8_params)
        for p, m, seen, v in zip(self.fp8_params, self.masters, self._written, now, strict=True):
            if seen != v and not _holds(p, m):
                m.detach().copy_(p.dequantize(torch.float32))
        self._written = now

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """adopt_changes_, copy_grads_, optimizer.step(), write_back_."""
        self._check_optimizer(optimizer)
        self.adopt_changes_()
        if capturing():  # a step graph's warmup or capture: it copies from now on
            self._mode.in_graph = True
        self.copy_grads_()
        optimizer.step()
        self.write_back_()

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per optimizer: it must hold every trainable master (or those weights would
        silently never train)."""
        if self._checked_optimizer is not None and self._checked_optimizer() is optimizer:
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [n for n, m in zip(self.names, self.masters, strict=True)
                   if m.requires_grad and id(m) not in held]  # fmt: skip
        if missing:
            raise ValueError(
                f"MasterWeights.step: the optimizer does not hold the fp32 masters of {missing}, "
                "which would never train: build it over masters.parameters()"
            )
        self._checked_optimizer = weakref.ref(optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the grads of the FP8 weights, the masters and the other parameters."""
        clear_grads((*self.masters, *self.others, *self.fp8_params), set_to_none)

    def state_dict(self) -> dict:
        """{"masters": {name: fp32 master}}; the optimizer's state_dict is saved separately."""
        return {
            "masters": {
                n: m.detach().clone() for n, m in zip(self.names, self.masters, strict=True)
            }
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restores the masters (bit for bit) and writes them into the FP8 weights."""
        saved = state["masters"]
        if sorted(saved) != sorted(self.names):
            raise ValueError(
                f"MasterWeights.load_state_dict: masters for {sorted(saved)}, the model's FP8 "
                f"weights are {sorted(self.names)}"
            )
        for n, m in zip(self.names, self.masters, strict=True):  # all checked before any copy
            t = saved[n]
            if not torch.is_tensor(t) or not t.is_floating_point() or t.shape != m.shape:
                what = f"{tuple(t.shape)} {t.dtype}" if torch.is_tensor(t) else type(t).__name__
                raise ValueError(
                    f"MasterWeights.load_state_dict: the master of {n} is {what}, the model's "
                    f"is {tuple(m.shape)} float32"
                )
        for n, m in zip(self.names, self.masters, strict=True):
            m.copy_(saved[n])
        self.write_back_()
