"""Where each weight of a Hugging Face decoder lives in graphfp8's TransformerLayer, per
architecture (Llama, Mistral, Qwen2; GPT-2), and the layer settings read from the HF config.

A layout entry maps one graphfp8 parameter to the HF tensors it is made of, in order:
q_proj, k_proj, v_proj rows stacked into the fused QKV weight (q heads, then k, then v: the
TransformerLayer's GQA layout), gate_proj and up_proj rows into fc1 (gate first, the gated MLP's
layout), and GPT-2's Conv1D weights, stored (in, out), transposed. Entries whose parameter is
missing (a bias the model does not have) are skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Entry", "Layout", "check_exact", "layout_for", "softmax_scales"]


@dataclass(frozen=True)
class Entry:
    """graphfp8 name (in a TransformerLayer, or in CausalLM for the top) <- HF names."""

    ours: str
    theirs: tuple[str, ...]
    transposed: bool = False  # GPT-2's Conv1D: (in, out)


@dataclass(frozen=True)
class Layout:
    """An architecture: its per-layer entries, top-level entries, and HF module paths."""

    name: str
    layer_entries: tuple[Entry, ...]
    top_entries: tuple[Entry, ...]
    layers_path: str  # the HF ModuleList of decoder layers
    embed_path: str
    norm_path: str
    pos_embed_path: str | None = None  # GPT-2's learned positions


def _e(ours, *theirs, transposed=False) -> Entry:
    return Entry(ours, theirs, transposed)


_LLAMA = Layout(
    "llama",
    (
        _e("qkv.layer_norm_weight", "input_layernorm.weight"),
        _e("qkv.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
           "self_attn.v_proj.weight"),
        _e("qkv.bias", "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        _e("proj.weight", "self_attn.o_proj.weight"),
        _e("proj.bias", "self_attn.o_proj.bias"),
        _e("mlp.layer_norm_weight", "post_attention_layernorm.weight"),
        _e("mlp.fc1_weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"),
        _e("mlp.fc1_bias", "mlp.gate_proj.bias", "mlp.up_proj.bias"),
        _e("mlp.fc2_weight", "mlp.down_proj.weight"),
        _e("mlp.fc2_bias", "mlp.down_proj.bias"),
    ),
    (_e("embed.weight", "model.embed_tokens.weight"), _e("norm.weight", "model.norm.weight"),
     _e("lm_head.weight", "lm_head.weight")),
    "model.layers",
    "model.embed_tokens",
    "model.norm",
)  # fmt: skip

_GPT2 = Layout(
    "gpt2",
    (
        _e("qkv.layer_norm_weight", "ln_1.weight"),
        _e("qkv.layer_norm_bias", "ln_1.bias"),
        _e("qkv.weight", "attn.c_attn.weight", transposed=True),
        _e("qkv.bias", "attn.c_attn.bias"),
        _e("proj.weight", "attn.c_proj.weight", transposed=True),
        _e("proj.bias", "attn.c_proj.bias"),
        _e("mlp.layer_norm_weight", "ln_2.weight"),
        _e("mlp.layer_norm_bias", "ln_2.bias"),
        _e("mlp.fc1_weight", "mlp.c_fc.weight", transposed=True),
        _e("mlp.fc1_bias", "mlp.c_fc.bias"),
        _e("mlp.fc2_weight", "mlp.c_proj.weight", transposed=True),
        _e("mlp.fc2_bias", "mlp.c_proj.bias"),
    ),
    (_e("embed.weight", "transformer.wte.weight"), _e("pos_embed.weight", "transformer.wpe.weight"),
     _e("norm.weight", "transformer.ln_f.weight"), _e("norm.bias", "transformer.ln_f.bias"),
     _e("lm_head.weight", "lm_head.weight")),
    "transformer.h",
    "transformer.wte",
    "transformer.ln_f",
    "transformer.wpe",
)  # fmt: skip

_FAMILY = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gpt2": _GPT2}
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def layout_for(config) -> Layout:
    kind = getattr(config, "model_type", None)
    if kind not in _FAMILY:
        raise ValueError(
            f"graphfp8.from_hf: model_type {kind!r} is not supported; supported: "
            f"{sorted(_FAMILY)} (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
            "GPT2LMHeadModel)"
        )
    return _FAMILY[kind]


def check_exact(config, layout: Layout) -> None:
    """Raises for a configuration that graphfp8's layers would not compute exactly: dropout (the
    layers have none), GPT-2's float32 attention and cross-attention."""
    if layout.name == "gpt2":
        drops = {k: getattr(config, k, 0.0) for k in ("embd_pdrop", "resid_pdrop", "attn_pdrop")}
        fixes = {"reorder_and_upcast_attn": False, "add_cross_attention": False}
    else:
        drops = {"attention_dropout": getattr(config, "attention_dropout", 0.0)}
        fixes = {"pretraining_tp": 1}
    drops = {k: v for k, v in drops.items() if v}
    if drops:
        args = ", ".join(f"{k}=0.0" for k in drops)
        raise ValueError(
            f"graphfp8.from_hf: the model has dropout {drops}, which graphfp8's layers do not run "
            f"(its training would silently lose it): load or build the model with {args} "
            f"(from_pretrained(name, {args}) or its config)"
        )
    wrong = {k: getattr(config, k) for k, v in fixes.items() if getattr(config, k, v) != v}
    if wrong:
        raise ValueError(f"graphfp8.from_hf: {wrong} is not converted; supported: "
                         f"{ {k: fixes[k] for k in wrong} }")  # fmt: skip


def softmax_scales(config, layout: Layout, num_layers: int) -> list[float | None]:
    """Each layer's attention scale, as the HF model computes it (None: 1 / sqrt(head_dim), the
    layers' default). GPT-2 can drop it (scale_attn_weights=False) and divide it by the layer
    number (scale_attn_by_inverse_layer_idx)."""
    if layout.name != "gpt2":
        return [None] * num_layers
    weights = getattr(config, "scale_attn_weights", True)
    by_layer = getattr(config, "scale_attn_by_inverse_layer_idx", False)
    if weights and not by_layer:
        return [None] * num_layers
    base = (config.n_embd // config.n_head) ** -0.5 if weights else 1.0
    return [base / float(i + 1) if by_layer else base for i in range(num_layers)]


def layer_kwargs(config, layout: Layout) -> dict:
    """TransformerLayer arguments for the HF config (less params_dtype, device, max_seq_len)."""
    if layout.name == "gpt2":
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"graphfp8.from_hf: GPT-2 activation {config.activation_function!r}"
                             " is not the tanh GELU")  # fmt: skip
        hidden = config.n_embd
        return dict(hidden_size=hidden, num_heads=config.n_head,
                    ffn_hidden_size=config.n_inner or 4 * hidden, rope=False,
                    eps=config.layer_norm_epsilon, activation="gelu")  # fmt: skip
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(f"graphfp8.from_hf: head_dim {head_dim} x {heads} heads != hidden size "
                         f"{hidden}: TransformerLayer's projections are square")  # fmt: skip
    if config.hidden_act != "silu":
        raise ValueError(f"graphfp8.from_hf: hidden_act {config.hidden_act!r}; the Llama family "
                         "converts with SwiGLU (silu)")  # fmt: skip
    qwen = layout.name == "llama" and config.model_type == "qwen2"
    attn_bias = bool(getattr(config, "attention_bias", False))
    return dict(hidden_size=hidden, num_heads=heads, ffn_hidden_size=config.intermediate_size,
                num_gqa_groups=getattr(config, "num_key_value_heads", None) or heads,
                eps=config.rms_norm_eps, normalization="RMSNorm", activation="swiglu",
                bias=attn_bias and not qwen, qkv_bias=qwen or attn_bias,
                mlp_bias=bool(getattr(config, "mlp_bias", False)))  # fmt: skip


def sliding_window(config) -> int | None:
    """The attention window of Mistral (and of Qwen2 with use_sliding_window), else None."""
    if config.model_type == "mistral" or getattr(config, "use_sliding_window", False):
        return getattr(config, "sliding_window", None)
    return None


def rope_tables(hf_model, config, max_seq_len: int, head_dim: int, device):
    """(cos, sin) float32 (max_seq_len, head_dim) from the model's own rotary embedding
    (inv_freq and attention_scaling, so scaled variants convert as they are), or None."""
    if config.model_type == "gpt2":
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _STATIC_ROPE:
        raise ValueError(f"graphfp8.from_hf: rope_type {kind!r} changes with the sequence; "
                         f"supported: {_STATIC_ROPE}")  # fmt: skip
    rotary = hf_model.get_submodule("model.rotary_emb")
    inv_freq = rotary.inv_freq.detach().to(device, torch.float64)
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError("graphfp8.from_hf: the rotary embedding does not cover the whole head")
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    angles = torch.arange(max_seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scaling).float(), (angles.sin() * scaling).float()


def max_positions(config) -> int:
    return (
        getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", 0)
        or (math.inf)
    )
