"""LoRA adapters between a converted model's fused names and Hugging Face's, exactly both ways.

    g8.lora.save_pretrained_hf(lora_model, "adapter")     # loads with peft onto the HF model
    lora_model = g8.lora.load_hf_adapter(model, "adapter")  # an HF adapter onto from_hf's model

A converted Llama / Mistral / Qwen2 (graphfp8.hf.from_hf) has one `qkv` projection where Hugging
Face has q_proj, k_proj, v_proj (rows stacked), and `proj` for o_proj. With x' the adapter's input
and s = lora_alpha / r (peft's scaling):

    saving:  B = [B_q; B_k; B_v] by rows (B: (out, r)); each of q/k/v gets A (r, in) and its B_i,
             so s * B_i A are the rows of s * B A: same r and lora_alpha, three modules.
    loading: A = [A_q; A_k; A_v] (rank r_q + r_k + r_v), B block-diagonal (B_i in rows i,
             columns of A_i, zeros elsewhere): B A = [B_q A_q; B_k A_k; B_v A_v]. The fused qkv
             adapter has rank n * r (n of q/k/v adapted; an absent one's rows are zero) and
             lora_alpha n * alpha, so its scaling is alpha / r, the same rounded value.

The MLP's gate/up projections sit inside LayerNormMLP, which takes no adapter (graphfp8/lora.py):
an HF adapter on gate/up/down_proj raises. Not supported (raise): GPT-2, rank_pattern or
alpha_pattern, q/k/v adapters of different r or alpha, use_rslora on loading (its sqrt(r) makes
the rescaled alpha inexact), modules_to_save and other non-LoRA entries. docs/integrations.md.
"""

from __future__ import annotations

import copy
import os
import re

import torch

__all__ = ["hf_adapter_state", "save_pretrained_hf"]

_ATTN = "self_attn."
_QKV = ("q_proj", "k_proj", "v_proj")
_FUSED = {"qkv": _QKV, "proj": ("o_proj",)}  # our module: its HF modules, rows in this order
_KEY = re.compile(r"^(?P<head>.*?)(?P<layer>\d+)\.(?P<mod>[\w.]+?)\.(?P<kind>lora_[AB])\.weight$")


def _layout(config, where: str):
    from graphfp8.hf.layouts import layer_kwargs, layout_for

    layout = layout_for(config)
    if layout.name != "llama":
        raise NotImplementedError(
            f"graphfp8.lora.{where}: only the Llama family (Llama, Mistral, Qwen2) is mapped; "
            f"{config.model_type} is not"
        )
    kw = layer_kwargs(config, layout)
    d = kw["hidden_size"] // kw["num_heads"]
    return layout, [kw["num_heads"] * d, kw["num_gqa_groups"] * d, kw["num_gqa_groups"] * d]


def _check_config(config, where: str, loading: bool) -> None:
    if config.rank_pattern or config.alpha_pattern:
        raise NotImplementedError(
            f"graphfp8.lora.{where}: rank_pattern / alpha_pattern are not mapped; use one r and "
            "lora_alpha for every module"
        )
    if loading and config.use_rslora:
        raise NotImplementedError(
            f"graphfp8.lora.{where}: use_rslora cannot be loaded exactly (the fused rank changes "
            "alpha / sqrt(r)); train the adapter without it"
        )
    if config.modules_to_save:
        raise NotImplementedError(
            f"graphfp8.lora.{where}: modules_to_save ({config.modules_to_save}) is not mapped"
        )


def _parse(key: str, where: str):
    m = _KEY.match(key)
    if m is None:
        raise NotImplementedError(
            f"graphfp8.lora.{where}: {key!r} is not a LoRA A/B weight of a decoder layer "
            "(only the layers' LoRA adapters are mapped)"
        )
    return m["head"], int(m["layer"]), m["mod"], m["kind"]


def save_pretrained_hf(peft_model, save_directory: str, adapter_name: str = "default") -> None:
    """Saves the adapter `adapter_name` of a peft model over a converted Llama-family model in
    Hugging Face's module names (adapter_config.json and adapter_model.safetensors), for
    `peft.PeftModel.from_pretrained(hf_model, save_directory)`: qkv's adapter as q/k/v_proj
    adapters of the same r and lora_alpha (B split by rows, A copied), proj's as o_proj's."""
    from peft.utils import SAFETENSORS_WEIGHTS_NAME, get_peft_model_state_dict
    from safetensors.torch import save_file

    where = "save_pretrained_hf"
    config = copy.deepcopy(peft_model.peft_config[adapter_name])
    _check_config(config, where, loading=False)
    layout, sizes = _layout(peft_model.base_model.model.config, where)
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name)
    out, targets = {}, set()
    for key, t in state.items():
        head, i, mod, kind = _parse(key, where)
        if mod not in _FUSED or not head.endswith("layers."):
            raise NotImplementedError(f"graphfp8.lora.{where}: {key!r}: no HF name for {mod!r}")
        theirs, head = _FUSED[mod], head.removesuffix("layers.")
        parts = t.split(sizes) if kind == "lora_B" and len(theirs) > 1 else [t] * len(theirs)
        for name, part in zip(theirs, parts, strict=True):
            hf = f"{head}{layout.layers_path}.{i}.{_ATTN}{name}.{kind}.weight"
            out[hf] = part.detach().contiguous().clone()
            targets.add(name)
    config.target_modules = sorted(targets)
    config._custom_modules = None
    os.makedirs(save_directory, exist_ok=True)
    config.save_pretrained(save_directory)
    path = os.path.join(save_directory, SAFETENSORS_WEIGHTS_NAME)
    save_file(out, path, metadata={"format": "pt"})


def _fuse(parts: dict[str, dict[str, torch.Tensor]], sizes: list[int], key: str):
    """(A, B) of the fused qkv adapter from {q/k/v_proj: {lora_A, lora_B}} (module docstring)."""
    a = torch.cat([parts[n]["lora_A"] for n in _QKV if n in parts])
    ref = next(iter(parts.values()))["lora_B"]
    b = ref.new_zeros(sum(sizes), a.shape[0])
    row = col = 0
    for name, size in zip(_QKV, sizes, strict=True):
        if name in parts:
            bi = parts[name]["lora_B"]
            if bi.shape[0] != size:
                raise ValueError(f"graphfp8.lora.load_hf_adapter: {key}{name}: {bi.shape[0]} rows, "
                                 f"the model's {name} has {size}")  # fmt: skip
            b[row : row + size, col : col + bi.shape[1]] = bi
            col += bi.shape[1]
        row += size
    return a, b


def hf_adapter_state(model, adapter_dir: str):
    """(LoraConfig, peft state dict) of the Hugging Face adapter saved in `adapter_dir`, mapped
    onto `model` (a converted Llama-family model): q/k/v_proj's adapters as one qkv adapter of
    rank n * r and lora_alpha n * alpha (n of them present; A stacked, B block-diagonal), o_proj's
    as proj's. graphfp8.lora.load_hf_adapter applies them."""
    import peft
    from peft.utils import load_peft_weights

    where = "load_hf_adapter"
    config = peft.LoraConfig.from_pretrained(adapter_dir)
    _check_config(config, where, loading=True)
    layout, sizes = _layout(model.config, where)
    prefix = layout.layers_path + "."
    groups: dict[tuple[str, int, str], dict[str, dict[str, torch.Tensor]]] = {}
    for key, t in load_peft_weights(adapter_dir).items():
        head, i, mod, kind = _parse(key, where)
        name = mod.removeprefix(_ATTN)
        if not head.endswith(prefix) or mod == name or name not in _QKV + ("o_proj",):
            raise NotImplementedError(
                f"graphfp8.lora.{where}: {key!r}: only the attention's q/k/v/o_proj adapters "
                "map onto a converted model (its LayerNormMLP takes none: graphfp8/lora.py)"
            )
        ours = "proj" if name == "o_proj" else "qkv"
        groups.setdefault((head[: -len(prefix)], i, ours), {}).setdefault(name, {})[kind] = t
    state, rank, alpha = {}, {}, {}
    for (head, i, ours), parts in sorted(groups.items()):
        key = f"{head}layers.{i}.{ours}"
        if ours == "proj":
            a, b = parts["o_proj"]["lora_A"], parts["o_proj"]["lora_B"]
        else:
            a, b = _fuse(parts, sizes, f"{head}{prefix}{i}.{_ATTN}")
        state[f"{key}.lora_A.weight"], state[f"{key}.lora_B.weight"] = a, b
        if a.shape[0] != config.r:
            pattern = re.escape(key.removeprefix("base_model.model."))
            rank[pattern], alpha[pattern] = a.shape[0], config.lora_alpha * len(parts)
    config.target_modules = sorted({k[2] for k in groups})
    config.rank_pattern, config.alpha_pattern = rank, alpha
    return config, state
