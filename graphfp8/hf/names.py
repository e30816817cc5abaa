"""A converted model's state dict in Hugging Face's names and back: to_hf splits q/k/v and gate/up
again and transposes GPT-2's Conv1D weights back; from_hf_names undoes it, in place.

A blockwise FP8 weight (Float8BlockTensor, 128x128 blocks) splits into blockwise pieces along
whole 128-row blocks, data and scales as stored (docs/integrations.md, "An FP8
checkpoint for serving"); a split inside a block raises, as no piece could hold its blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.hf.layouts import Entry, Layout, layer_kwargs, layout_for
from graphfp8.ops.blockwise import TILE

__all__ = ["FP8_PREFIX", "from_hf_names", "to_hf"]

FP8_PREFIX = "graphfp8."  # the FP8 state's keys in a Hugging Face directory
# HF buffers that are not weights (GPT-2's causal-mask buffers, rotary frequencies).
_IGNORED = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _to_hf_entry(state: dict, ours: str, prefix: str, entry: Entry, sizes,
                 dequantize: bool) -> dict:  # fmt: skip
    if ours not in state:
        return {}
    t = state[ours]
    if isinstance(t, Float8BlockTensor) and dequantize:
        t = t.dequantize()
    if len(entry.theirs) == 1:
        return {prefix + entry.theirs[0]: t.t() if entry.transposed else t}
    if isinstance(t, Float8BlockTensor) and not entry.transposed:
        parts = split_blocks(t, sizes, ours, [prefix + name for name in entry.theirs])
    else:
        parts = t.split(sizes)
    return {prefix + name: part for name, part in zip(entry.theirs, parts, strict=True)}


def split_blocks(t: Float8BlockTensor, sizes: list[int], ours: str,
                 theirs: list[str]) -> list[Float8BlockTensor]:  # fmt: skip
    """t (N, K) split into row pieces of `sizes` along whole 128-row blocks: each piece's data
    rows and block-scale rows are views of t's (the stored bytes, nothing quantized again).

    Raises:
        ValueError: a piece starts inside a 128-row block (that block's one scale covers rows of
            two HF weights, whose checkpoints hold separate blocks).
    """
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    inside = [(name, a) for name, a in zip(theirs, starts, strict=True) if a % TILE]
    if inside:
        name, a = inside[0]
        raise ValueError(
            f"graphfp8.to_hf: {ours} holds blockwise FP8 weights in 128x128 blocks, but "
            f"{name} starts at row {a}, inside a block (rows {sizes} per HF weight): its block "
            "scales cannot be split between the HF weights without quantizing again. Pass "
            "dequantize=True for the high-precision values (save_pretrained with fp8=False or "
            "fp8=True does), or use head and FFN sizes whose rows are multiples of 128"
        )
    return [
        Float8BlockTensor(
            t._data[a : a + n],
            t._scale_inv[a // TILE : -(-(a + n) // TILE)],
            t.dtype,
            t._power_2_scale,
        )  # fmt: skip
        for a, n in zip(starts, sizes, strict=True)
    ]


def _split_sizes(config, layout: Layout, entry: Entry) -> list[int] | None:
    if len(entry.theirs) == 1:
        return None
    kw = layer_kwargs(config, layout)
    if entry.ours.startswith("mlp."):
        return [kw["ffn_hidden_size"]] * 2
    d = kw["hidden_size"] // kw["num_heads"]
    return [kw["num_heads"] * d, kw["num_gqa_groups"] * d, kw["num_gqa_groups"] * d]


def to_hf(model_or_state, config=None, dequantize: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict (q/k/v and gate/up split again, GPT-2's Conv1D weights
    transposed back) of a converted model or of its state_dict (a checkpoint).

    Args:
        model_or_state: a CausalLM, or a CausalLM state_dict (FP8 state entries are dropped).
        config: the HF config; needed with a state dict.
        dequantize: blockwise FP8 weights (Float8BlockTensor) as their dequantized values in
            their nominal dtype; False keeps them blockwise, split along whole 128-row blocks
            (module docstring: a split inside a block raises).

    Returns:
        {HF name: tensor} for `HFModelClass(config).load_state_dict(...)` (views where no copy
        is needed; tied embeddings give the same tensor twice, as HF's own state dict does).
    """
    if isinstance(model_or_state, nn.Module):
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
        out.update(_to_hf_entry(state, entry.ours, "", entry, None, dequantize))
    sizes = {e.ours: _split_sizes(config, layout, e) for e in layout.layer_entries}
    for i in range(n):
        for entry in layout.layer_entries:
            out.update(_to_hf_entry(state, f"layers.{i}.{entry.ours}", f"{layout.layers_path}.{i}.",
                                    entry, sizes[entry.ours], dequantize))  # fmt: skip
    return out


def _hf_key_map(config) -> list[tuple[str, list[str], bool]]:
    """(our name, [HF names], transposed) for every weight of the model."""
    layout = layout_for(config)
    n = getattr(config, "num_hidden_layers", None) or config.n_layer
    out = [(e.ours, list(e.theirs), e.transposed) for e in layout.top_entries]
    for i in range(n):
        out += [(f"layers.{i}.{e.ours}", [f"{layout.layers_path}.{i}.{t}" for t in e.theirs],
                 e.transposed) for e in layout.layer_entries]  # fmt: skip
    return out


def from_hf_names(state: dict, config, prefix: str = "") -> None:
    """Rewrites, in place, the Hugging Face entries of `state` under `prefix` into a converted
    model's names (q/k/v and gate/up concatenated, Conv1D weights transposed, a tied LM head
    that HF's save_pretrained left out taken from the embedding; `graphfp8.` FP8 state
    unprefixed). A state dict in graphfp8's names is left as it is (a tied head left out is
    reported missing, as safetensors' load_model expects)."""
    layout = layout_for(config)
    if any(k.startswith(f"{prefix}{layout.layers_path}.") for k in state):
        _rename_hf(state, config, prefix)
    for k in [k for k in state if k.startswith(prefix + FP8_PREFIX)]:
        state[prefix + k[len(prefix + FP8_PREFIX) :]] = state.pop(k)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of the row pieces; blockwise pieces of whole 128-row blocks (to_hf's) stay
    blockwise, their data and scales concatenated as stored (torch.cat would dequantize them,
    and a blockwise weight would then quantize the values again on load)."""
    blocks = all(isinstance(p, Float8BlockTensor) for p in parts)
    if not blocks or any(p.shape[0] % TILE for p in parts[:-1]):
        return torch.cat(parts)
    if len({(p._power_2_scale, p.dtype) for p in parts}) > 1:
        return torch.cat(parts)
    return Float8BlockTensor(torch.cat([p._data for p in parts]),
                             torch.cat([p._scale_inv for p in parts]), parts[0].dtype,
                             parts[0]._power_2_scale)  # fmt: skip


def _rename_hf(state: dict, config, prefix: str) -> None:
    for ours, theirs, transposed in _hf_key_map(config):
        keys = [prefix + t for t in theirs]
        if not all(k in state for k in keys):
            continue  # missing: reported by load_state_dict under our name
        parts = [state.pop(k) for k in keys]
        parts = [p.t() for p in parts] if transposed else parts
        state[prefix + ours] = parts[0] if len(parts) == 1 else _cat(parts)
    # Hugging Face's save_pretrained leaves a tied head out (its loader ties it again).
    head, embed = prefix + "lm_head.weight", prefix + "embed.weight"
    if getattr(config, "tie_word_embeddings", False) and head not in state and embed in state:
        state[head] = state[embed]
    for k in [k for k in state if k.startswith(prefix) and k.endswith(_IGNORED)]:
        del state[k]
