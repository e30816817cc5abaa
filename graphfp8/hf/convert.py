"""from_hf: a Hugging Face decoder-only model as graphfp8 TransformerLayers, the weights moved
rather than copied; to_hf: the Hugging Face state dict of such a model (or of its checkpoint).

Moving: a parameter that keeps its shape (norms, o_proj, down_proj, embeddings, LM head) is the
HF Parameter itself; a fused one (q/k/v -> qkv, gate/up -> fc1) is one concatenation, after
which the HF model's q_proj, k_proj, ... weights are re-pointed at views of it, so the old
tensors are freed and both models see the same numbers (training the converted model trains the
HF one). GPT-2's Conv1D weights, stored (in, out), are transposed once the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.hf.layouts import (
    Entry,
    Layout,
    layer_kwargs,
    layout_for,
    max_positions,
    rope_tables,
    sliding_window,
)
from graphfp8.hf.model import CausalLM
from graphfp8.modules.transformer import TransformerLayer

__all__ = ["from_hf", "to_hf"]


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


def from_hf(model: nn.Module, max_seq_len: int | None = None) -> CausalLM:
    """A Hugging Face LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
    GPT2LMHeadModel as graphfp8 TransformerLayers: FP8 GEMMs under fp8_autocast, graphable.

    Args:
        model: the HF model, on its device and in its dtype (bf16 for training); it keeps
            working, sharing every weight with the result (module docstring).
        max_seq_len: longest sequence (RoPE tables); default min(max_position_embeddings, 4096).

    Returns:
        CausalLM: input_ids (B, S) -> logits (B, S, vocab).
    """
    config = model.config
    layout = layout_for(config)
    hf_layers = model.get_submodule(layout.layers_path)
    ref = next(model.parameters())
    kw = layer_kwargs(config, layout)
    seq = min(max_seq_len or 4096, max_positions(config))
    tables = rope_tables(model, config, seq, kw["hidden_size"] // kw["num_heads"], ref.device)
    layers = []
    for i in range(len(hf_layers)):
        layer = TransformerLayer(**kw, max_seq_len=seq, params_dtype=ref.dtype, device="meta")
        for entry in layout.layer_entries:
            _move(model, f"{layout.layers_path}.{i}.", layer, entry)
        layer.core_attention._device_anchor = torch.empty(0, device=ref.device)
        if tables is not None:  # one pair of tables for every layer
            layer.rope_cos, layer.rope_sin = tables
        _check_moved(layer, i)
        layers.append(layer)
    pos = model.get_submodule(layout.pos_embed_path) if layout.pos_embed_path else None
    return CausalLM(layout.name, config, model.get_submodule(layout.embed_path), layers,
                    model.get_submodule(layout.norm_path), model.get_submodule("lm_head"), pos,
                    sliding_window(config))  # fmt: skip


def _to_hf_entry(state: dict, ours: str, prefix: str, entry: Entry, sizes) -> dict:
    if ours not in state:
        return {}
    t = state[ours]
    if len(entry.theirs) == 1:
        return {prefix + entry.theirs[0]: t.t() if entry.transposed else t}
    return {prefix + name: part for name, part in zip(entry.theirs, t.split(sizes), strict=True)}


def _split_sizes(config, layout: Layout, entry: Entry) -> list[int] | None:
    if len(entry.theirs) == 1:
        return None
    kw = layer_kwargs(config, layout)
    if entry.ours.startswith("mlp."):
        return [kw["ffn_hidden_size"]] * 2
    d = kw["hidden_size"] // kw["num_heads"]
    return [kw["num_heads"] * d, kw["num_gqa_groups"] * d, kw["num_gqa_groups"] * d]


def to_hf(model_or_state, config=None) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (q/k/v and gate/up split again, GPT-2's Conv1D weights
    transposed back) of a converted model or of its state_dict (a checkpoint).

    Args:
        model_or_state: a CausalLM, or a CausalLM state_dict (FP8 state entries are dropped).
        config: the HF config; needed with a state dict.

    Returns:
        {HF name: tensor} for `HFModelClass(config).load_state_dict(...)` (views where no copy
        is needed; tied embeddings give the same tensor twice, as HF's own state dict does).
    """
    if isinstance(model_or_state, CausalLM):
        config = model_or_state.config
        state = model_or_state.state_dict()
    else:
        state = model_or_state
        if config is None:
            raise ValueError("graphfp8.to_hf: a state dict needs the model's HF config")
    layout = layout_for(config)
    n = getattr(config, "num_hidden_layers", None) or config.n_layer
    out = {}
    for entry in layout.top_entries:
        out.update(_to_hf_entry(state, entry.ours, "", entry, None))
    for i in range(n):
        for entry in layout.layer_entries:
            sizes = _split_sizes(config, layout, entry)
            out.update(_to_hf_entry(state, f"layers.{i}.{entry.ours}",
                                    f"{layout.layers_path}.{i}.", entry, sizes))  # fmt: skip
    return out
