"""A converted model's per-layer CUDA graphs behind one switch: `g8.from_hf(hf, recipe=r,
graphs="layers")` captures every TransformerLayer (make_graphed_callables, chained, FP8 with the
carried recipe and weight caching) at the first training forward that can replay them, and
replays them from then on, in any loop (Trainer, accelerate, Lightning).

A forward replays the graphs when it trains (module.training, grad enabled) inside the carried
region, with the captured (batch, seq) and nothing the graphs do not take: no attention_mask,
segment_ids, position_ids (RoPE models), cache or inputs_embeds. Evaluation runs the layers'
eager forward (torch's rule for another training mode), which leaves the graphs' FP8 state as
it was; a training batch of another shape raises (the graphs' input check). Replays called
without is_first_microbatch cast the FP8 weights, as the eager carried model does
(graphfp8.modules.carry says why). For the whole step as one graph, loops that own their step
call make_graphed_step on the model instead (a capture's FP8 settings win over the carried
ones).
"""

from __future__ import annotations

import torch

from graphfp8.graphs import make_graphed_callables

__all__ = ["LayerGraphs"]

GRAPH_MODES = (None, "layers")


class LayerGraphs:
    """The per-layer graphs of one CausalLM (captured lazily)."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None

    def replays(self, model, input_ids, eligible: bool) -> bool:
        """Whether this forward runs through the graphs (capturing them first if needed)."""
        if not (eligible and model.training and torch.is_grad_enabled()):
            return False
        if input_ids is None or input_ids.dim() != 2:
            return False
        shape = tuple(input_ids.shape)
        if self.shape is None:
            self._capture(model, shape)
        return True

    def _capture(self, model, shape: tuple[int, int]) -> None:
        ref = model.embed.weight
        grad = ref.requires_grad or (model.pos_embed is not None
                                     and model.pos_embed.weight.requires_grad)  # fmt: skip
        sample = torch.randn(*shape, model.layers[0].hidden_size, dtype=ref.dtype,
                             device=ref.device, requires_grad=grad)  # fmt: skip
        samples = tuple((sample if i == 0 else sample.detach().clone().requires_grad_(grad),)
                        for i in range(len(model.layers)))  # fmt: skip
        carry = model.fp8
        make_graphed_callables(tuple(model.layers), samples, fp8_enabled=True,
                               fp8_recipe=carry.recipe, fp8_weight_caching=True,
                               fp8_group=carry.fp8_group, chain=True)  # fmt: skip
        self.shape = shape
