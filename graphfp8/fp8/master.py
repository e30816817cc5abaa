"""MasterWeights: fp32 master copies of a model's FP8 primary weights, for a torch optimizer.

    masters = g8.MasterWeights(model)                  # model built inside fp8_model_init
    opt = torch.optim.AdamW(masters.parameters(), ...)  # fp32 masters + the model's other params
    ... forward / backward (is_first_microbatch=True on each step's first microbatch) ...
    masters.step(opt)        # grads -> masters, opt.step(), masters -> FP8 weights (one cast each)
    masters.zero_grad()

The write-back quantizes each master with its own amax (graphfp8.fp8.primary.WeightQuantizer)
and marks the weight's transpose cache stale; the next forward with is_first_microbatch=True (or
None) rebuilds it, in a graph as the captured transpose node. Every step is device work only.
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.fp8.primary import WeightQuantizer
from graphfp8.fp8.tensor import Float8Tensor

__all__ = ["MasterWeights"]


class MasterWeights:
    """fp32 masters of every FP8 primary weight of `model`; other parameters are used as they are.

    Args:
        model: a module with FP8 primary weights (created inside graphfp8.fp8_model_init).
    """

    def __init__(self, model: nn.Module) -> None:
        named = list(model.named_parameters())
        self.names = [n for n, p in named if isinstance(p, Float8Tensor)]
        self.fp8_params = [p for _, p in named if isinstance(p, Float8Tensor)]
        if not self.fp8_params:
            raise ValueError(
                "MasterWeights: the model has no FP8 primary weights; create its graphfp8 layers "
                "inside graphfp8.fp8_model_init()"
            )
        self.others = [p for _, p in named if not isinstance(p, Float8Tensor)]
        self.masters = [
            p.dequantize(torch.float32).requires_grad_(p.requires_grad) for p in self.fp8_params
        ]
        self.quantizers = [WeightQuantizer(p.fp8_dtype, p.device) for p in self.fp8_params]
        # From here on every FP8 weight is exactly its master quantized: the same bits as the
        # forward's own weight cast of a high-precision model holding the masters would give.
        self.write_back_()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor that step() changes besides the model's and the optimizer's: the masters
        and the quantizers' scales (a graph capture snapshots and restores them)."""
        return [*self.masters, *(q.scale for q in self.quantizers)]

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer updates: the fp32 masters, then the model's other parameters."""
        return [*self.masters, *self.others]

    @torch.no_grad()
    def copy_grads_(self) -> None:
        """Each FP8 weight's .grad (its nominal dtype) into its master's fp32 .grad."""
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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """copy_grads_, optimizer.step(), write_back_."""
        self.copy_grads_()
        optimizer.step()
        self.write_back_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the grads of the FP8 weights, the masters and the other parameters."""
        for t in (*self.fp8_params, *self.masters, *self.others):
            if t.grad is None:
                continue
            if set_to_none:
                t.grad = None
            else:
                t.grad.zero_()

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
        for n, m in zip(self.names, self.masters, strict=True):
            m.copy_(saved[n])
        self.write_back_()
