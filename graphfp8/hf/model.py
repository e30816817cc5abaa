"""graphfp8's form of a Hugging Face decoder-only language model, shaped like one: the HF
embedding, final norm and LM head modules themselves around graphfp8 TransformerLayers, with
Hugging Face's forward arguments and outputs, generate(), config and save_pretrained().

    input_ids (B, S) -> embed (+ learned positions, GPT-2) -> TransformerLayers -> norm -> lm_head

A `transformers.PreTrainedModel` (and GenerationMixin), so Trainer, accelerate and generate()
treat it as one of theirs. Each TransformerLayer can be graphed on its own (make_graphed_callables
on the tuple of `layers`: the loop below then calls the graphs), or the whole model with
make_graphed_step. Importing this module imports transformers (graphfp8.hf loads it lazily).
"""

from __future__ import annotations

import contextlib

import torch
import transformers
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from graphfp8.hf import checkpoints
from graphfp8.hf.inputs import attention_inputs, gpt2_positions
from graphfp8.hf.layer_graphs import LayerGraphs
from graphfp8.modules._context import in_fp8_region
from graphfp8.modules.base import fp8_entries_hook
from graphfp8.modules.carry import FP8Carry

__all__ = ["CausalLM"]


def check_transformers(version: str) -> None:
    """Refuses transformers 4.x (setup.cfg's [hf] extra asks for the tested 5.24)."""
    if int(version.split(".")[0]) < 5:
        raise ImportError(
            f"graphfp8.hf needs transformers >= 5.24 (setup.cfg's [hf] extra), found {version}: "
            "4.x's caches and generate() differ (generate() failed). "
            "pip install -U 'transformers>=5.24'"
        )


check_transformers(transformers.__version__)

# transformers 5.24 names the cache `cache`, earlier 5.x `past_key_values`.
_CACHE_FIELD = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class CausalLM(PreTrainedModel, GenerationMixin):
    """A converted model (graphfp8.from_hf builds it; graphfp8.to_hf writes it back).

    Attributes:
        arch: "llama" (Llama, Mistral, Qwen2) or "gpt2".
        config: a copy of the Hugging Face config it was converted from.
        hf_class: the Hugging Face model class (what save_pretrained writes).
        embed, norm, lm_head: the HF model's own modules (shared, not copied; tied embeddings
            stay tied).
        layers: nn.ModuleList of graphfp8.TransformerLayer.
        pos_embed: GPT-2's learned position embedding (the HF module), else None.
        sliding_window: attention window (Mistral); longer inputs raise.
        fp8: the carried FP8Carry (graphfp8.modules.carry), or None: FP8 only inside the
            caller's fp8_autocast.
        layer_graphs: the per-layer graphs (graphfp8.hf.layer_graphs, graphs="layers"), or None.
    """

    config_class = PretrainedConfig
    base_model_prefix = "graphfp8"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["TransformerLayer"]

    def __init__(self, arch: str, config, embed: nn.Module, layers: list[nn.Module],
                 norm: nn.Module, lm_head: nn.Module, pos_embed: nn.Module | None = None,
                 sliding_window: int | None = None, hf_class: type | None = None,
                 fp8: FP8Carry | None = None, graphs: str | None = None):  # fmt: skip
        super().__init__(config)
        self.loss_type = "ForCausalLM"  # Trainer counts num_items_in_batch over shifted labels
        self.arch, self.sliding_window, self.hf_class = arch, sliding_window, hf_class
        self.embed, self.layers, self.norm, self.lm_head = (
            embed,
            nn.ModuleList(layers),
            norm,
            lm_head,
        )
        self.pos_embed = pos_embed
        self.fp8 = fp8
        self.layer_graphs = LayerGraphs() if graphs == "layers" else None
        self.all_tied_weights_keys = {}  # PreTrainedModel.post_init's; the HF modules keep ties
        self.register_load_state_dict_pre_hook(checkpoints.from_hf_names_hook)
        self.register_load_state_dict_pre_hook(fp8_entries_hook)  # all or nothing

    # Hugging Face's interface -------------------------------------------------------------------

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed = value

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def tie_weights(self, *args, **kwargs) -> None:
        """The embeddings are the HF model's modules, tied (or not) as they were; a new input
        embedding (resize_token_embeddings) is tied again where the config ties them."""
        tied = getattr(self.config.get_text_config(), "tie_word_embeddings", False)
        if tied and self.lm_head.weight is not self.embed.weight:
            self.lm_head.weight = self.embed.weight

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """Writes a directory that AutoModelForCausalLM.from_pretrained loads (graphfp8.hf.
        save_pretrained, whose keyword arguments it takes)."""
        checkpoints.save_pretrained(self, save_directory, *args, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        """Hugging Face's switch (TrainingArguments(gradient_checkpointing=True)): every layer
        recomputes its activations in the backward, TransformerLayer(recompute="full"), with the
        FP8 state exact (docs/fp8.md, "Activation recompute"); always non-reentrant, whatever
        gradient_checkpointing_kwargs say."""
        self._set_recompute("full")

    def gradient_checkpointing_disable(self) -> None:
        self._set_recompute("none")

    activation_checkpointing_enable = gradient_checkpointing_enable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(layer.recompute != "none" for layer in self.layers)

    def _set_recompute(self, mode: str) -> None:
        if self.layer_graphs is not None and self.layer_graphs.shape is not None:
            raise RuntimeError(
                "graphfp8.hf: the per-layer graphs are captured and keep what they captured; "
                "switch gradient checkpointing before the first training forward"
            )
        for layer in self.layers:
            layer.recompute = mode

    # Forward ------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask=None,
                position_ids=None, past_key_values=None, cache=None, inputs_embeds=None,
                labels=None, use_cache: bool | None = None, return_dict: bool | None = None,
                logits_to_keep: int = 0, segment_ids=None,
                is_first_microbatch: bool | None = None, **kwargs):  # fmt: skip
        """Hugging Face's causal-LM forward.

        Args:
            input_ids: (B, S) int64 (or inputs_embeds (B, S, H)).
            attention_mask: (B, T) 0/1 padding mask over the cached and new tokens.
            position_ids: (B, S) int64 positions (packed documents restart them).
            past_key_values / cache: a transformers Cache (generate() passes one); use_cache
                without one starts a DynamicCache.
            labels: (B, S) int64, the inputs themselves (-100: not counted); `.loss` is
                Hugging Face's shifted mean cross entropy (num_items_in_batch from Trainer).
            return_dict: False returns a tuple (loss first when labels are given).
            logits_to_keep: compute logits for the last this many tokens only (0: all).
            segment_ids: graphfp8's (B, S) packed documents (graphfp8.ops.segments).
            is_first_microbatch: as for graphfp8.Linear (None casts the FP8 weights; the
                carried recipe passes nothing else: graphfp8.modules.carry).
            **kwargs: num_items_in_batch; others Hugging Face passes are ignored;
                output_attentions / output_hidden_states raise.

        Returns:
            CausalLMOutputWithPast (loss, logits (B, S', vocab) in the parameters' dtype, the
            cache), or its tuple.
        """
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise NotImplementedError(f"graphfp8.hf: {name}=True is not supported")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.config)
        region = self.fp8.region(self) if self.fp8 is not None else contextlib.nullcontext()
        graphs, eager_layers = self.layer_graphs, False
        if graphs is not None:
            segments = segment_ids
            if segments is None and attention_mask is not None and attention_mask.dim() == 2:
                segments = attention_mask.to(torch.int64)  # as inputs.attention_inputs makes them
            refused = _why_not_graphed(cache, inputs_embeds, position_ids, self.arch != "gpt2")
            _, eager_layers = graphs.plan(self, input_ids, segments, refused)
        with region:
            x = self._hidden(input_ids, inputs_embeds, attention_mask, position_ids, cache,
                             segment_ids, is_first_microbatch, eager_layers)  # fmt: skip
            if logits_to_keep:
                x = x[:, -logits_to_keep:]
            logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = ForCausalLMLoss(logits, labels, self.config.vocab_size,
                                   num_items_in_batch=kwargs.get("num_items_in_batch"))  # fmt: skip
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
        return out if return_dict is not False else out.to_tuple()

    def _hidden(self, input_ids, inputs_embeds, attention_mask, position_ids, cache, segment_ids,
                is_first_microbatch, eager_layers: bool = False) -> torch.Tensor:  # fmt: skip
        """The last layer's output (B, S, H); eager_layers: run graphed layers' eager forward."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("graphfp8.hf: give exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        self._check_length(past + s, position_ids)
        inputs = attention_inputs(self.arch != "gpt2", b, s, past, cache is not None,
                                  attention_mask, position_ids, segment_ids)  # fmt: skip
        if self.pos_embed is not None:
            x = x + self.pos_embed(gpt2_positions(b, s, past, position_ids, segment_ids, x.device))
        for i, layer in enumerate(self.layers):
            call = type(layer).forward.__get__(layer) if eager_layers else layer
            x = call(x, is_first_microbatch=is_first_microbatch, **inputs.layer_kwargs(cache, i))
        return x

    def _check_length(self, total: int, position_ids) -> None:
        """A sliding window or GPT-2's learned positions limit the length (raises before any
        work)."""
        if self.sliding_window is not None and total > self.sliding_window:
            raise ValueError(
                f"graphfp8.hf: {total} tokens exceed the model's attention window "
                f"{self.sliding_window} (sliding-window attention is not converted)"
            )
        if self.pos_embed is None:
            tables = self.layers[0].max_seq_len if self.layers[0].rope else None
            last = total if position_ids is None else int(position_ids.max()) + 1
            if tables is not None and last > tables:
                raise ValueError(
                    f"graphfp8.hf: position {last - 1} is past the rotary tables of {tables} "
                    "positions; convert with graphfp8.from_hf(..., max_seq_len=) of the longest "
                    "sequence (generate(): prompt + max_new_tokens; the default is "
                    "min(max_position_embeddings, 4096))"
                )
            return
        limit = self.pos_embed.num_embeddings
        last = total if position_ids is None else int(position_ids.max()) + 1
        if last > limit:
            raise ValueError(
                f"graphfp8.hf: GPT-2 has learned positions for {limit} tokens (n_positions), got "
                f"{'a position_id of ' + str(last - 1) if position_ids is not None else last}"
                f"{' tokens' if position_ids is None else ''}"
            )

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8 is None else f", carried recipe={self.fp8.recipe}"
        return f"arch={self.arch}, model_type={self.config.model_type}{fp8}"


def _why_not_graphed(cache, inputs_embeds, position_ids, rope: bool) -> str | None:
    """Why a forward's arguments cannot replay the layer graphs (graphfp8.hf.layer_graphs), None
    when they can."""
    if in_fp8_region():
        return "inside the caller's fp8_autocast region or capture"
    if cache is not None:
        return "a cache (past_key_values, use_cache)"
    if inputs_embeds is not None:
        return "inputs_embeds"
    if rope and position_ids is not None:
        return "position_ids with rotary positions (explicit attention)"
    return None
