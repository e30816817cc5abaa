"""A converted model's per-layer CUDA graphs behind one switch: `g8.from_hf(hf, recipe=r,
graphs="layers")` captures every TransformerLayer (make_graphed_callables, chained, FP8 with the
carried recipe and weight caching) at the first training forward that can replay them, and
replays them from then on, in any loop (Trainer, accelerate, Lightning).

A forward replays the graphs when it trains (module.training, grad enabled) inside the carried
region, with the captured (batch, seq) and the captured kind of attention: the padding mask a
tokenizer returns (`attention_mask`: all ones, right or left padding) or graphfp8's segment_ids
are a device input of the graphs (the layers' segment ids, graphs/runner.py copies each call's
in), so any mask replays with no host decision and no sync; a batch without one replays graphs
captured without one. Anything else runs the layers' eager forward, the same as a model without
graphs, and is counted: evaluation (torch's rule for another training mode) silently, a training
forward with one warning per reason (another (batch, seq), such as an epoch's last partial
batch; a mask where the capture had none or the reverse; position_ids with RoPE; a cache;
inputs_embeds; the caller's own fp8_autocast). `model.layer_graphs.counts` reads
{"replayed": n, "eager": m, "eager_reasons": {reason: k}}.

Evaluation leaves the graphs' FP8 state as it was. Replays called without is_first_microbatch
cast the FP8 weights, as the eager carried model does (graphfp8.modules.carry says why). For the
whole step as one graph, loops that own their step call make_graphed_step on the model instead
(a capture's FP8 settings win over the carried ones).
"""

from __future__ import annotations

import warnings

import torch

from graphfp8.graphs import make_graphed_callables
from graphfp8.graphs.compiled import opaque_to_dynamo

__all__ = ["LayerGraphs"]

GRAPH_MODES = (None, "layers")
EVALUATION = "evaluation (eval mode or no grad)"


class LayerGraphs:
    """The per-layer graphs of one CausalLM (captured lazily) and the count of forwards that
    replayed them or ran eagerly.

    Attributes:
        shape: the captured (batch, seq), None before the capture.
        segments: whether the capture took segment ids (a padding mask), None before it.
        replayed: forwards that replayed the graphs.
        eager_reasons: {reason: forwards} of those that ran the layers eagerly.
    """

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.segments: bool | None = None
        self.replayed = 0
        self.eager_reasons: dict[str, int] = {}

    @property
    def counts(self) -> dict:
        """{"replayed": forwards, "eager": forwards, "eager_reasons": {reason: forwards}}."""
        return {"replayed": self.replayed, "eager": sum(self.eager_reasons.values()),
                "eager_reasons": dict(self.eager_reasons)}  # fmt: skip

    @opaque_to_dynamo
    def plan(self, model, input_ids, segment_ids, refused: str | None) -> tuple[bool, bool]:
        """One forward's decisions: (replay the graphs, run the captured layers' eager forward).
        Opaque to torch.compile (Trainer's torch_compile=True): dynamo runs it, and the capture
        inside it, eagerly, and compiles the code around it."""
        replay = self.replays(model, input_ids, segment_ids, refused)
        return replay, not replay and self.shape is not None

    def replays(self, model, input_ids, segment_ids, refused: str | None) -> bool:
        """Whether this forward runs through the graphs (capturing them first if needed).

        Args:
            model: the CausalLM.
            input_ids: (B, S) int64, or None.
            segment_ids: (B, S) integer segment ids the layers get (a padding mask), or None.
            refused: why the call's arguments cannot replay (None: they can).
        """
        reason = self._refusal(model, input_ids, segment_ids, refused)
        if reason is None:
            if self.shape is None:
                self._capture(model, tuple(input_ids.shape), segment_ids)
            self.replayed += 1
            return True
        self.eager_reasons[reason] = self.eager_reasons.get(reason, 0) + 1
        if reason != EVALUATION and self.eager_reasons[reason] == 1:
            warnings.warn(f"graphfp8.hf: graphs=\"layers\": this training forward ran the layers "
                          f"eagerly ({reason}); model.layer_graphs.counts counts replays and "
                          "eager forwards (said once per reason)", stacklevel=3)  # fmt: skip
        return False

    def _refusal(self, model, input_ids, segment_ids, refused: str | None) -> str | None:
        """Why this forward runs eagerly, None when it replays (module docstring)."""
        if not (model.training and torch.is_grad_enabled()):
            return EVALUATION
        if refused is not None:
            return refused
        if input_ids is None or input_ids.dim() != 2:
            return "inputs_embeds, or input_ids not (batch, seq)"
        shape = tuple(input_ids.shape)
        if self.shape is not None and shape != self.shape:
            return f"input_ids {shape}, the graphs were captured for {self.shape}"
        if self.segments is not None and self.segments != (segment_ids is not None):
            had, has = ("with", "without") if self.segments else ("without", "with")
            return f"the graphs were captured {had} an attention_mask or segment_ids, called {has}"
        return None

    def _capture(self, model, shape: tuple[int, int], segment_ids) -> None:
        ref = model.embed.weight
        grad = ref.requires_grad or (model.pos_embed is not None
                                     and model.pos_embed.weight.requires_grad)  # fmt: skip
        sample = torch.randn(*shape, model.layers[0].hidden_size, dtype=ref.dtype,
                             device=ref.device, requires_grad=grad)  # fmt: skip
        samples = tuple((sample if i == 0 else sample.detach().clone().requires_grad_(grad),)
                        for i in range(len(model.layers)))  # fmt: skip
        # Each layer's own static buffer for the segment ids (the replay copies the call's in).
        kwargs = tuple({} if segment_ids is None else {"segment_ids": segment_ids.clone()}
                       for _ in model.layers)  # fmt: skip
        carry = model.fp8
        make_graphed_callables(tuple(model.layers), samples, sample_kwargs=kwargs,
                               fp8_enabled=True, fp8_recipe=carry.recipe,
                               fp8_weight_caching=True, fp8_group=carry.fp8_group,
                               chain=True)  # fmt: skip
        self.shape, self.segments = shape, segment_ids is not None
