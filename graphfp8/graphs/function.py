"""The autograd.Function of a graphed callable: its forward replays the forward graph, its backward
the backward graph, in the order its capture's Schedule allows (graphs/schedule.py)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["GraphedFunction"]


class GraphedFunction(torch.autograd.Function):
    """Replays a GraphedRunner's forward graph in forward and its backward graph in backward
    (graphs/runner.py: its contract, graph pair and capture).

    Inputs: the runner, whether this call leaves a backward to run, the grad anchor (an empty
    tensor that requires grad when the parameters do, so the outputs require grad even if no
    user input does), the user tensors. The autograd node (ctx) is what the schedule tracks:
    while it lives, the runner's backward is pending. The backward is once_differentiable: a
    captured backward has no autograd graph of its own, so create_graph=True (a gradient penalty)
    raises at the second backward instead of silently dropping its terms.
    """

    @staticmethod
    def forward(ctx, runner, expects_backward: bool, anchor, *inputs):
        ctx.runner = runner
        pair = runner.pair
        pair.replay_forward(inputs)
        ctx.versions = pair.versions()
        runner.capture.schedule.forward_done(runner.contract.index,
                                             ctx if expects_backward else None)  # fmt: skip
        outs = tuple(o.detach() for o in pair.static_outputs)
        ctx.mark_non_differentiable(
            *[o for o, g in zip(outs, pair.static_grad_outputs, strict=True) if g is None]
        )
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        runner = ctx.runner
        name, index, schedule = runner.contract.name, runner.contract.index, runner.capture.schedule
        if runner.capture.closed:
            raise RuntimeError(
                f"{name}: backward through outputs made before reset() released the graphs"
            )
        schedule.check_backward(index, ctx)
        runner.pair.check_versions(name, ctx.versions)
        runner.contract.guard.main_grads.check()  # replaced since the forward (docs/fp8.md)
        grad_inputs = runner.pair.replay_backward(grads)
        schedule.backward_done(index)
        runner.contract.guard.main_grads.set_added()  # as the eager backward (docs/fp8.md)
        return (None, None, None, *grad_inputs)
