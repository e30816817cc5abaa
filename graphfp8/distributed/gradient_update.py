"""The end of every optimizer step, reduce -> clip -> step -> write back, as one protocol that
every kind of training state follows: the step graph (graphs/step.py) and the training loop
(training/run.py) call it the same way, whatever is sharded (docs/sharding.md).

    update = gradient_update(model.parameters, group, masters, name="...")   # once
    update.reduce_grads_()                   # all-reduce (replicated) or reduce-scatter (sharded)
    grad_norm = update.clip_grad_norm_(1.0)  # optional: the global L2 norm, torch's formula
    update.step(optimizer)                   # optimizer.step(), the FP8 weights written back
    update.zero_grad()

ShardedMasterWeights follows it itself (it owns its reduction); replicated parameters, with or
without unsharded or FSDP2 masters, follow it through ReplicatedUpdate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from graphfp8.distributed.data_parallel import allreduce_gradients
from graphfp8.distributed.sharded_masters import ShardedMasterWeights
from graphfp8.fp8.master import MasterWeights, clear_grads
from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["GradientUpdate", "ReplicatedUpdate", "gradient_update"]


class GradientUpdate(Protocol):
    """What an optimizer step does after the last microbatch's backward."""

    def optimizer_params(self, model_params: list[torch.Tensor], name: str) -> list:
        """What the optimizer must hold, given the model's trainable parameters (raises, naming
        `name`, if the training state does not cover them)."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """Tensors the step changes besides the model's and the optimizer's (a capture snapshots
        and restores them)."""
        ...

    def reduce_grads_(self) -> None: ...

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor: ...

    def step(self, optimizer: torch.optim.Optimizer) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class ReplicatedUpdate:
    """Replicated parameters: their gradients averaged over `group` (allreduce_gradients; None: no
    reduction), clipped by torch.nn.utils.clip_grad_norm_, stepped by the optimizer or through
    `masters` (unsharded or FSDP2 MasterWeights, which write the FP8 weights back).

    Args:
        params: a function returning the parameters whose gradients are reduced and clipped
            (called at each step: e.g. model.parameters).
        group: the data-parallel torch.distributed group, or None.
        masters: a MasterWeights (not sharded), or None.
        check_every_step: allreduce_gradients' check_every_step.
    """

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]], group=None,
                 masters: MasterWeights | None = None,
                 check_every_step: bool = True) -> None:  # fmt: skip
        self.params, self.group, self.masters = params, group, masters
        self.check_every_step = check_every_step

    def optimizer_params(self, model_params: list[torch.Tensor], name: str) -> list:
        """The model's trainable parameters, with the FP8 primary weights replaced by their fp32
        masters (which the masters must cover, and only them)."""
        fp8 = [p for p in model_params if isinstance(p, Float8Tensor)]
        masters = self.masters
        if masters is None and not fp8:
            return list(model_params)
        if masters is None or {id(p) for p in fp8} != {id(p) for p in masters.fp8_params}:
            raise ValueError(
                f"{name}: a model with FP8 primary weights (fp8_model_init) needs "
                "master_weights=graphfp8.MasterWeights(model) covering exactly its trainable FP8 "
                "weights, and an optimizer over master_weights.parameters()"
            )
        return [*masters.masters, *(p for p in model_params if not isinstance(p, Float8Tensor))]

    def tensors(self) -> list[torch.Tensor]:
        return self.masters.tensors() if self.masters is not None else []

    def reduce_grads_(self) -> None:
        if self.group is not None:
            allreduce_gradients(self.params(), self.group, check_every_step=self.check_every_step)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.params(), max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), through the masters when there are any (grads into the fp32
        masters, the step, one cast back per FP8 weight)."""
        if self.masters is not None:
            self.masters.step(optimizer)
        else:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.masters is not None:
            self.masters.zero_grad(set_to_none)
        else:
            clear_grads(self.params(), set_to_none)


def gradient_update(params: Callable[[], Iterable[torch.Tensor]], group=None,
                    masters: MasterWeights | None = None, *, name: str,
                    check_every_step: bool = True,
                    keep_grads: bool = False) -> GradientUpdate:  # fmt: skip
    """The GradientUpdate of a training state: sharded masters are their own; anything else is a
    ReplicatedUpdate of `params` over `group`.

    Args:
        params: a function returning the parameters that get gradients (replicated training),
            called at each step.
        group: the data-parallel group whose gradients are all-reduced; None with sharded
            masters (they reduce-scatter over their own group).
        masters: the MasterWeights of any kind, or None.
        name: the caller, named in errors.
        check_every_step: allreduce_gradients' check_every_step.
        keep_grads: whether the caller copies the reduced gradients (sharded masters keep only
            this rank's slice of them).
    """
    if isinstance(masters, ShardedMasterWeights):
        if group is not None:
            raise ValueError(
                f"{name}: master_weights are sharded (MasterWeights(shard_group=...)): they "
                "reduce-scatter the gradients themselves; an all-reduce over process_group would "
                "reduce them twice. Pass process_group=None"
            )
        if keep_grads:
            raise ValueError(
                f"{name}: keep_grads_before_clipping with sharded master_weights: the reduced "
                "gradients are this rank's slices (masters.grad_shards)"
            )
        return masters
    return ReplicatedUpdate(params, group, masters, check_every_step)
