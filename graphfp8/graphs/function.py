"""The autograd.Function of a graphed callable: its forward replays the forward graph, its backward
the backward graph, in the order its capture's Schedule allows (graphs/schedule.py)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["GraphedFunction"]


class GraphedFunction(torch.autograd.Function):
    """Replays a GraphedRunner's forward graph in forward and its backward graph in backward.

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
        runner.replay_forward(inputs)
        ctx.versions = runner.versions()
        runner.graphs.schedule.forward_done(runner.index, ctx if expects_backward else None)
        outs = tuple(o.detach() for o in runner.static_outputs)
        ctx.mark_non_differentiable(
            *[o for o, g in zip(outs, runner.static_grad_outputs, strict=True) if g is None]
        )
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        runner = ctx.runner
        if runner.graphs.closed:
            raise RuntimeError(
                f"{runner.name}: backward through outputs made before reset() released the graphs"
            )
        runner.graphs.schedule.check_backward(runner.index, ctx)
        runner.check_versions(ctx.versions)
        grad_inputs = runner.replay_backward(grads)
        runner.graphs.schedule.backward_done(runner.index)
        return (None, None, None, *grad_inputs)
