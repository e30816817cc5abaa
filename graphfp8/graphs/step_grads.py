"""The step graph's gradient accumulation into its static .grad buffers, with WGRAD_INTO_GRAD.

The step graph keeps one static `.grad` per parameter and accumulates each microbatch's
gradients into it as AccumulateGrad does after zero_grad(set_to_none=True): the first
microbatch's copied, the others added (graphs/step.py, StepBody). Under GRAPHFP8_WGRAD_INTO_GRAD
(read at capture) the capture is also an into_grad Target (graphfp8/fp8/into_grad.py): a
weight-gradient GEMM writes its weight's static buffer itself, with beta 0 on the weight's first
write of the step (the first microbatch) and 1 after, constants of the graph since every replay
starts a step; autograd then gives the weight None, and a gradient it still gives (another use
of the weight) is added after the GEMM's write, as eagerly (docs/fp8.md, "Straight into
`.grad`").
"""

from __future__ import annotations

import torch

from graphfp8.fp8 import into_grad

__all__ = ["StepGrads"]


class StepGrads:
    """Folds each microbatch's gradients into the step's static buffers (`grads`, one per
    parameter of `params`), and, as an into_grad Target while open (`routing()`), lets the
    weight-gradient GEMMs write them."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self.grads = grads
        self.index = {id(p): j for j, p in enumerate(params)}
        self.written: set[int] = set()  # the buffers a GEMM wrote in this capture
        self.beta_zero = self.ones = None
        if into_grad.switched_on() and grads:
            # (alpha, beta) rows (1, 0) and (1, 1): the step graph holds their addresses, and
            # this object (the StepBody's) keeps them allocated as long as the graph.
            table = torch.tensor([[1.0, 0.0], [1.0, 1.0]], device=grads[0].device)
            self.beta_zero, self.ones = table[0], table[1]

    def routing(self):
        """Routes the block's weight-gradient GEMMs here (the capture; warmup takes dW)."""
        return into_grad.capturing(self)

    def into_grad(self, weight: torch.Tensor, dtype: torch.dtype):
        """into_grad.Target: (the weight's static buffer, (alpha, beta)) or None (dW)."""
        j = self.index.get(id(weight))
        if self.ones is None or j is None or not into_grad.plain(weight, self.grads[j], dtype):
            return None
        first = j not in self.written
        self.written.add(j)
        return self.grads[j], self.beta_zero if first else self.ones

    def wrote(self, weight: torch.Tensor) -> bool:
        """into_grad.Target: whether a GEMM of this capture wrote `weight`'s buffer."""
        j = self.index.get(id(weight))
        return j is not None and j in self.written

    def accumulate(self, i: int, grads: list[torch.Tensor | None]) -> None:
        """Microbatch i's autograd gradients (one per buffer, None where a GEMM wrote it): the
        first microbatch's copied into the buffers no GEMM wrote, every other added."""
        copies, adds = ([], []), ([], [])
        for j, (b, g) in enumerate(zip(self.grads, grads, strict=True)):
            if g is not None:
                into = copies if i == 0 and j not in self.written else adds
                into[0].append(b)
                into[1].append(g)
        if copies[0]:
            torch._foreach_copy_(*copies)
        if adds[0]:
            torch._foreach_add_(*adds)
