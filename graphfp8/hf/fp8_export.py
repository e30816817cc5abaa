"""An FP8 checkpoint of a converted model for serving: E4M3 GEMM weights with per-tensor scales in
the layout Hugging Face transformers' "fp8" quantization (FineGrainedFP8, per-tensor) or vLLM's
"fp8" method read; every other tensor (embeddings, norms, biases, the LM head) in high precision.

    config.json  "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                 "weight_block_size": null, <skip list>: ["lm_head"]}
    weights      <module>.weight        float8_e4m3fn (out, in)
                 <module>.<weight scale>  float32 ()   dequantized weight = weight * scale
                 <module>.<input scale>   float32 ()   (activation_scheme "static" only)

The two readers differ in names only (transformers 5.24: `weight_scale_inv`, `activation_scale`,
`modules_to_not_convert`; vLLM: `weight_scale`, `input_scale`, `ignored_layers`; both store the
dequantization multiplier, 1 / the quantization scale). Each ignores or rejects the other's: a
vLLM-layout checkpoint loaded by transformers keeps the raw FP8 values as weights (its scales are
"unexpected" keys), so the layout is chosen explicitly and defaults to transformers' (whose
misuse in vLLM fails loudly on the unknown key).

The "blockwise" layout (DeepSeek-V3's, the one transformers' fine-grained FP8 loader, vLLM and
SGLang read for block-quantized checkpoints) quantizes each GEMM weight in 128x128 blocks, one
float32 `weight_scale_inv` (ceil(out / 128), ceil(in / 128)) per weight (graphfp8/ops/blockwise.py
with float32 scales: scale_inv = 1 / (fp8_max / the block's amax)), under transformers' names, with
"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]} (activations are scaled
per 1x128 tile at run time by the reader: "dynamic" only). A model whose weights are blockwise FP8
already (fp8_model_init(recipe=Float8BlockScaling()): Float8BlockTensor) exports its stored
blocks and scales bit for bit, nothing quantized again (a block's dequantized values quantized
again can give other bytes, or other values under float32 scales); q/k/v and gate/up are split
along whole 128-row blocks (graphfp8/hf/names.py), and a split inside a block raises.

The GEMM weights are the HF tensors of graphfp8's FP8 GEMMs (q/k/v/o and gate/up/down
projections). Each gets its own scale from its amax (fp8_max / amax, graphfp8's scale rule), so
nothing saturates. "static" takes each GEMM's input scale from the delayed-scaling state of
training (the scale of the INPUT slot), shared by the projections that read the same input.
"""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.recipe import fp8_max
from graphfp8.fp8.slots import FwdRole, slot_index
from graphfp8.hf.layouts import layout_for
from graphfp8.hf.names import to_hf
from graphfp8.ops.blockwise import TILE, quantize_blocks

__all__ = ["LAYOUTS", "fp8_checkpoint", "quantize_128x128", "quantize_per_tensor"]

E4M3 = torch.float8_e4m3fn
# (weight scale, input scale, skip-list key) per reader.
LAYOUTS = {
    "transformers": ("weight_scale_inv", "activation_scale", "modules_to_not_convert"),
    "vllm": ("weight_scale", "input_scale", "ignored_layers"),
    "blockwise": ("weight_scale_inv", "activation_scale", "modules_to_not_convert"),
}
# graphfp8 GEMM weight -> (the TransformerLayer submodule that runs it, its GEMM number there).
_GEMMS = {
    "qkv.weight": ("qkv", 0),
    "proj.weight": ("proj", 0),
    "mlp.fc1_weight": ("mlp", 0),
    "mlp.fc2_weight": ("mlp", 1),
}


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in), any float dtype -> (E4M3 (out, in), scale_inv float32 ()): w ~ fp8 * scale_inv.

    The scale is fp8_max / amax(w) (1 for an all-zero or non-finite amax), computed in float32
    like graphfp8's scale update, so no value saturates.
    """
    w32 = w.detach().float()
    amax = w32.abs().amax()
    ok = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(ok, fp8_max(E4M3) / amax, torch.ones_like(amax))
    limit = fp8_max(E4M3)
    return (w32 * scale).clamp(-limit, limit).to(E4M3), scale.reciprocal().reshape(())


def _check_finite(state: dict, keys: list[str]) -> None:
    """Refuses GEMM weights holding NaN or inf, before anything is quantized or written: E4M3
    would keep a NaN, and an inf amax leaves the scale at 1, saturating the weight to 448."""
    bad = [k for k in keys if not bool(torch.isfinite(state[k]).all())]
    if bad:
        raise ValueError(
            f"FP8 export: {len(bad)} GEMM weight(s) hold NaN or inf values, which an FP8 "
            f"checkpoint cannot represent: {bad[:8]}{' ...' if len(bad) > 8 else ''}; nothing "
            "was written. Restore the weights from a good checkpoint (a diverged run) or save "
            "in high precision (fp8=False) to inspect them"
        )


def quantize_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (out, in) -> (E4M3 (out, in), scale_inv float32 (ceil(out / 128), ceil(in / 128))): each
    128x128 block scaled by fp8_max / its amax (float32 scales, not powers of 2)."""
    return quantize_blocks(w.detach(), E4M3, power_2_scale=False)


def _export_weight(w: torch.Tensor, quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, its scale_inv): a blockwise FP8 weight's stored blocks under the blockwise
    layout (copies: safetensors writes no shared storage), else `quantize` of its value."""
    if isinstance(w, Float8BlockTensor):
        if quantize is quantize_128x128:
            return w._data.clone(), w._scale_inv.clone()
        w = w.dequantize()
    return quantize(w)


def _layer_gemms(layout, i: int) -> list[tuple[str, str, tuple[str, ...]]]:
    """(our weight name, HF prefix, HF names) of layer i's FP8 GEMM weights."""
    prefix = f"{layout.layers_path}.{i}."
    return [(e.ours, prefix, e.theirs) for e in layout.layer_entries if e.ours in _GEMMS]


def _input_scale_inv(layer: nn.Module, ours: str) -> torch.Tensor:
    module_name, gemm = _GEMMS[ours]
    module = getattr(layer, module_name)
    meta = module.fp8_meta
    if meta is None:
        raise ValueError(
            "graphfp8.hf FP8 export: activation_scheme='static' needs the input scales of "
            f"training, but layer {module_name} never ran in FP8 (train or run it under "
            "fp8_autocast first, or use activation_scheme='dynamic')"
        )
    return meta.fwd.scales()[slot_index(FwdRole.INPUT, gemm)].float().reciprocal().reshape(())


def fp8_checkpoint(model: nn.Module, layout: str = "transformers",
                   activation_scheme: str = "dynamic",
                   hf_state: dict | None = None) -> tuple[dict, dict]:  # fmt: skip
    """The FP8 state dict and quantization_config of a converted model (graphfp8.from_hf).

    Args:
        model: the converted CausalLM (its config, layers and FP8 state).
        layout: "transformers", "vllm" or "blockwise" (module docstring).
        activation_scheme: "dynamic" (activations scaled at run time by the reader) or "static"
            (input scales from training's FP8 state).
        hf_state: the HF state dict to convert (default graphfp8.to_hf(model), blockwise FP8
            weights kept blockwise for the "blockwise" layout, else dequantized).

    Returns:
        ({HF name: tensor}: GEMM weights E4M3 with their scales, everything else as given,
        {the config's quantization_config}).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"FP8 export: layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if activation_scheme not in ("dynamic", "static"):
        raise ValueError(
            "FP8 export: activation_scheme must be 'dynamic' or 'static', got "
            f"{activation_scheme!r}"
        )
    block = layout == "blockwise"
    if block and activation_scheme != "dynamic":
        raise ValueError(
            "FP8 export: the blockwise layout scales activations per 1x128 tile at run time "
            "(activation_scheme='dynamic'); static per-tensor input scales do not apply"
        )
    config = model.config
    arch = layout_for(config)
    if any(e.transposed for e in arch.layer_entries):
        raise NotImplementedError(
            f"FP8 export: {config.model_type}'s GEMMs are Conv1D modules, which the readers of "
            "FP8 checkpoints do not quantize; supported: Llama, Mistral, Qwen2"
        )
    weight_key, input_key, skip_key = LAYOUTS[layout]
    state = dict(to_hf(model, dequantize=not block) if hf_state is None else hf_state)
    entries = [e for i in range(len(model.layers)) for e in _layer_gemms(arch, i)]
    _check_finite(state, [prefix + name for _, prefix, theirs in entries for name in theirs])
    quantize = quantize_128x128 if block else quantize_per_tensor
    for i, layer in enumerate(model.layers):
        for ours, prefix, theirs in _layer_gemms(arch, i):
            keys = [prefix + name for name in theirs]
            x_scale = _input_scale_inv(layer, ours) if activation_scheme == "static" else None
            if x_scale is not None and not bool(torch.isfinite(x_scale)):
                raise ValueError(
                    f"FP8 export: layer {i}'s {ours} input scale of training is not finite "
                    f"({float(x_scale)}); use activation_scheme='dynamic'"
                )
            for key in keys:
                module = key[: -len("weight")]
                state[key], state[module + weight_key] = _export_weight(state[key], quantize)
                if x_scale is not None:
                    state[module + input_key] = x_scale.clone()
    quant = {
        "quant_method": "fp8",
        "activation_scheme": activation_scheme,
        "weight_block_size": None,
        skip_key: ["lm_head"],
    }
    if block:
        quant.update(fmt="e4m3", weight_block_size=[TILE, TILE])
    return state, quant
