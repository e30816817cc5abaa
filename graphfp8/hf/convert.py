"""from_hf: a Hugging Face decoder-only model as graphfp8 TransformerLayers, the weights moved
rather than copied; to_hf: the Hugging Face state dict of such a model (or of its checkpoint).

Moving: a parameter that keeps its shape (norms, o_proj, down_proj, embeddings, LM head) is the
HF Parameter itself; a fused one (q/k/v -> qkv, gate/up -> fc1) is one concatenation, after
which the HF model's q_proj, k_proj, ... weights are re-pointed at views of it, so the old
tensors are freed and both models see the same numbers (training the converted model trains the
HF one). GPT-2's Conv1D weights, stored (in, out), are transposed once the same way.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from graphfp8.fp8.primary import INIT
from graphfp8.fp8.recipe import Recipe
from graphfp8.hf.layer_graphs import GRAPH_MODES
from graphfp8.hf.layouts import (
    Entry,
    check_exact,
    layer_kwargs,
    layout_for,
    max_positions,
    rope_tables,
    sliding_window,
    softmax_scales,
)
from graphfp8.modules.carry import FP8Carry, init_fp8_state
from graphfp8.modules.transformer import TransformerLayer

__all__ = ["from_hf"]


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    owner, _, name = path.rpartition(".")
    return (root.get_submodule(owner) if owner else root), name


def _move(hf_root: nn.Module, prefix: str, layer: nn.Module, entry: Entry) -> None:
    """Gives layer its parameter `entry.ours` from the HF tensors under `prefix`."""
    owner, name = _parent(layer, entry.ours)
    if getattr(owner, name, None) is None:  # a bias this layer does not have
        return
    theirs = []
    for path in entry.theirs:
        hf_owner, hf_name = _parent(hf_root, prefix + path)
        theirs.append((hf_owner, hf_name, getattr(hf_owner, hf_name)))
    if any(t is None for *_, t in theirs):
        raise ValueError(f"graphfp8.from_hf: {prefix}{entry.theirs} is missing for {entry.ours}")
    if len(theirs) == 1 and not entry.transposed:
        setattr(owner, name, theirs[0][2])  # the HF Parameter itself
        return
    with torch.no_grad():
        pieces = [t.t() if entry.transposed else t for *_, t in theirs]
        fused = nn.Parameter(torch.cat(pieces) if len(pieces) > 1 else pieces[0].contiguous())
    setattr(owner, name, fused)
    start = 0
    for hf_owner, hf_name, t in theirs:  # the HF tensors become views of the fused one
        rows = t.shape[1] if entry.transposed else t.shape[0]
        view = fused.data[start : start + rows]
        setattr(hf_owner, hf_name, nn.Parameter(view.t() if entry.transposed else view,
                                                requires_grad=t.requires_grad))  # fmt: skip
        start += rows


def _check_moved(layer: nn.Module, i: int) -> None:
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        if t.is_meta:
            raise RuntimeError(f"graphfp8.from_hf: layer {i} {name} was not converted")


def _check_convertible(model: nn.Module) -> None:
    if INIT.enabled:
        raise RuntimeError(
            "graphfp8.from_hf moves the Hugging Face model's own (high-precision) weights, so "
            "inside fp8_model_init it would make no FP8 primary weights: call it outside, or "
            "build graphfp8 layers inside fp8_model_init and load_state_dict the HF weights"
        )
    if getattr(model, "_graphfp8_converted", False):
        raise ValueError(
            "graphfp8.from_hf: this Hugging Face model was converted already and shares its "
            "weights with that CausalLM (a second conversion would make the HF model follow the "
            "new, separate copy): keep using the first CausalLM, or convert a fresh HF model"
        )


def from_hf(model: nn.Module, max_seq_len: int | None = None, recipe: Recipe | None = None,
            fp8_group=None, eval_fp8: bool = True,
            graphs: str | None = None):  # fmt: skip
    """A Hugging Face LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
    GPT2LMHeadModel as graphfp8 TransformerLayers: FP8 GEMMs, graphable, Hugging Face's forward
    arguments and outputs (graphfp8.hf.model.CausalLM).

    Args:
        model: the HF model, on its device and in its dtype (bf16 for training); it keeps
            working, sharing every weight with the result (module docstring). A model can be
            converted once.
        max_seq_len: longest sequence (the RoPE tables); default min(max_position_embeddings,
            4096). A longer one is taken, as Hugging Face's rotary models run past
            max_position_embeddings; GPT-2's learned positions stop at n_positions (longer
            raises).
        recipe: the FP8 recipe the model carries (graphfp8.modules.carry): it then runs in FP8
            by itself, with no fp8_autocast in the training loop. None: FP8 only inside the
            caller's fp8_autocast.
        fp8_group, eval_fp8: the carried settings (FP8Carry); need a recipe.
        graphs: None (eager), or "layers": every decoder layer a CUDA graph, captured at the
            first training forward and replayed in any training loop (graphfp8.hf.layer_graphs:
            fixed-shape batches, with the tokenizer's attention_mask or without; other
            forwards run eagerly, warned once per reason, and `model.layer_graphs.counts`
            counts both); needs a recipe.

    Returns:
        CausalLM: input_ids (B, S) -> CausalLMOutputWithPast (loss with labels, logits (B, S,
        vocab)).

    Raises:
        ValueError: before anything changes, for a model or configuration it would not convert
            exactly (unsupported architecture or settings, dropout, a second conversion).
    """
    from graphfp8.hf.model import CausalLM

    _check_convertible(model)
    carry = FP8Carry(recipe, fp8_group, eval_fp8) if recipe is not None else None
    if graphs not in GRAPH_MODES or (graphs is not None and carry is None):
        raise ValueError(f"graphfp8.from_hf: graphs must be one of {GRAPH_MODES} (not None only "
                         f"with a recipe), got {graphs!r}")  # fmt: skip
    config = model.config
    layout = layout_for(config)
    check_exact(config, layout)
    kw = layer_kwargs(config, layout)
    hf_layers = model.get_submodule(layout.layers_path)
    scales = softmax_scales(config, layout, len(hf_layers))
    ref = next(model.parameters())
    seq = _max_seq_len(config, max_seq_len)
    tables = rope_tables(model, config, seq, kw["hidden_size"] // kw["num_heads"], ref.device)
    layers = []
    for i in range(len(hf_layers)):
        layer = TransformerLayer(**kw, max_seq_len=seq, params_dtype=ref.dtype, device="meta",
                                 softmax_scale=scales[i])  # fmt: skip
        for entry in layout.layer_entries:
            _move(model, f"{layout.layers_path}.{i}.", layer, entry)
        layer.core_attention._device_anchor = torch.empty(0, device=ref.device)
        if tables is not None:  # one pair of tables for every layer
            layer.rope_cos, layer.rope_sin = tables
        _check_moved(layer, i)
        layers.append(layer)
    model._graphfp8_converted = True
    pos = model.get_submodule(layout.pos_embed_path) if layout.pos_embed_path else None
    lm = CausalLM(layout.name, copy.deepcopy(config), model.get_submodule(layout.embed_path),
                  layers, model.get_submodule(layout.norm_path), model.get_submodule("lm_head"),
                  pos, sliding_window(config), type(model), carry, graphs)  # fmt: skip
    if carry is not None:
        init_fp8_state(lm, carry.recipe, ref.device)
    return lm


def _max_seq_len(config, max_seq_len: int | None) -> int:
    """The rotary tables' length (from_hf's max_seq_len)."""
    if max_seq_len is None:
        return min(4096, max_positions(config))
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"graphfp8.from_hf: max_seq_len must be a positive int, got "
                         f"{max_seq_len!r}")  # fmt: skip
    if config.model_type == "gpt2" and max_seq_len > config.n_positions:
        raise ValueError(
            f"graphfp8.from_hf: max_seq_len={max_seq_len}, but GPT-2 has learned positions for "
            f"{config.n_positions} tokens (n_positions)"
        )
    return max_seq_len
