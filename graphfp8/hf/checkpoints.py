"""A converted model's checkpoints in Hugging Face's layout: save_pretrained writes a directory that
AutoModelForCausalLM.from_pretrained loads, and a converted model loads Hugging Face state dicts.

    g8.hf.save_pretrained(model, "out")        # config.json, generation_config.json,
                                               # model.safetensors in HF names
    model.load_state_dict(hf_model.state_dict())   # HF names: q/k/v fused again, strict=True

The FP8 state (each layer's `_extra_state` tensor, modules/_state_tensor.py) is saved beside the
weights as `graphfp8.<layer>._extra_state` unless fp8_state=False, so Trainer's checkpoints
resume bit for bit; from_pretrained lists these keys as UNEXPECTED and ignores them. A state
dict without them loads as fresh FP8 state. save_pretrained(fp8=...) writes the FP8 checkpoint
for serving of graphfp8/hf/fp8_export.py instead.
"""

from __future__ import annotations

import copy

import torch

from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.hf.fp8_export import fp8_checkpoint
from graphfp8.hf.names import FP8_PREFIX, from_hf_names, to_hf

__all__ = ["from_hf_names_hook", "save_pretrained"]


def save_pretrained(model, save_directory, state_dict: dict | None = None,
                    fp8_state: bool = True, fp8: bool | str = False,
                    activation_scheme: str = "dynamic", **kwargs) -> None:  # fmt: skip
    """Writes `model` (a CausalLM from graphfp8.from_hf) as its Hugging Face class would.

    Args:
        model: the converted model.
        save_directory: the directory (created).
        state_dict: the model's own state dict to write (Trainer passes one under some
            set-ups); default model.state_dict().
        fp8_state: also write the FP8 state (module docstring).
        fp8: write an FP8 checkpoint for serving instead (graphfp8/hf/fp8_export.py): E4M3
            GEMM weights with per-tensor scales and a quantization_config, in the layout of
            "transformers" (True: AutoModelForCausalLM loads it) or "vllm"; "blockwise": 128x128
            weight blocks with float32 weight_scale_inv (DeepSeek-V3's layout, which
            transformers' fine-grained FP8 loader reads; blockwise FP8 weights are written as
            stored); no FP8 state.
        activation_scheme: with fp8, "dynamic" or "static" (input scales from training).
        **kwargs: the Hugging Face class's save_pretrained arguments (safe_serialization,
            max_shard_size, is_main_process, push_to_hub, ...).
    """
    if model.hf_class is None:
        raise ValueError("graphfp8.hf.save_pretrained: the model does not know its Hugging Face "
                         "class (build it with graphfp8.from_hf)")  # fmt: skip
    ours = model.state_dict() if state_dict is None else state_dict
    memo: dict[int, torch.Tensor] = {}  # one copy per tensor: tied embeddings stay one tensor
    # Blockwise FP8 weights stay blocks only for the blockwise export (written as stored).
    hf = to_hf(ours, model.config, dequantize=fp8 != "blockwise")
    hf_state = {k: memo.setdefault(id(t), _copy(t)) for k, t in hf.items()}
    quantization = None
    if fp8:
        hf_state, quantization = fp8_checkpoint(model, "transformers" if fp8 is True else fp8,
                                                activation_scheme, hf_state)  # fmt: skip
    elif fp8_state:
        hf_state.update({FP8_PREFIX + k: t.detach() for k, t in ours.items()
                         if k.endswith("_extra_state")})  # fmt: skip
    config = copy.deepcopy(model.config)
    config.architectures = [model.hf_class.__name__]
    with torch.device("meta"):
        shell = model.hf_class(config).to(model.embed.weight.dtype)
    shell.generation_config = copy.deepcopy(model.generation_config)
    if quantization is not None:
        shell.config.quantization_config = quantization
    shell.save_pretrained(save_directory, state_dict=hf_state, **kwargs)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy; a blockwise FP8 weight's copy keeps its blocks (clone() would give its
    dequantized values)."""
    if isinstance(t, Float8BlockTensor):
        return Float8BlockTensor(t._data.clone(), t._scale_inv.clone(), t.dtype,
                                 t._power_2_scale)  # fmt: skip
    return t.detach().clone()


def from_hf_names_hook(module, state_dict, prefix, *args) -> None:
    """CausalLM's load_state_dict pre-hook: loads Hugging Face state dicts (from_hf_names)."""
    from_hf_names(state_dict, module.config, prefix)
