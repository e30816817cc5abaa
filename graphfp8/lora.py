"""LoRA on graphfp8's FP8 layers with peft: high-precision adapters over a frozen FP8 base.

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["qkv", "proj"])
    model = peft.get_peft_model(model, config)      # graphfp8.Linear / LayerNormLinear targets
    model.save_pretrained("adapter"); peft.PeftModel.from_pretrained(graphfp8_model, "adapter")

A targeted graphfp8.Linear becomes LoraLinear, a graphfp8.LayerNormLinear LoraLayerNormLinear
(graphfp8.te's layers, their subclasses, too): peft's custom-module mapping (LoraConfig.
_register_custom_module, peft's experimental API) of any LoRA config gets them when peft dispatches
a graphfp8 target (graphfp8/lora_dispatch.py, installed by `import graphfp8`); `register(config)`
adds them explicitly.

    y = base(x) + B(A(dropout(x'))) * scaling,   x' = x (Linear), norm(x) (LayerNormLinear)

The base runs as always: FP8 GEMMs under fp8_autocast, from a high-precision weight (cast once
per step with is_first_microbatch) or an FP8 parameter (fp8_model_init: 1 byte per weight); peft
freezes it, so its weight gradient is never computed. A and B are ordinary torch Linear layers in
the adapters' dtype. LayerNormLinear's adapter reads the norm's output, the input its weight
sees, so merging (W += scaling * B @ A, as peft merges a torch Linear) gives the same function.
Graphs capture the adapters with the rest (make_graphed_callables, make_graphed_step).

Hugging Face's names (q/k/v_proj for the fused qkv), exactly both ways: save_pretrained_hf and
load_hf_adapter (graphfp8/lora_hf.py).

Not supported (raise): LoRA variants (DoRA, ...), fan_in_fan_out, lora_bias, mixed adapter batches
(adapter_names), a Float8Tensor input (fp8_output=True of the previous layer), merging into an
FP8 parameter, and LayerNormMLP targets (its two GEMMs sit inside one fused call: target qkv and
proj, or convert the MLP's linears with graphfp8.convert instead).
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as _PeftLoraLinear
from torch import nn

from graphfp8 import modules
from graphfp8.fp8 import Float8Tensor
from graphfp8.lora_hf import hf_adapter_state, save_pretrained_hf

__all__ = ["LoraLayerNormLinear", "LoraLinear", "load_hf_adapter", "lora_layers", "register",
           "save_pretrained_hf"]  # fmt: skip

# peft's LoRA options whose variants or extras these layers do not implement (name: off value).
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "use_bdlora": None,
    "velora_config": None,
    "arrow_config": None,
    "alora_invocation_tokens": None,
    "monteclora_config": None,
    "mica": None,
    "kasa_config": None,
}


def _check_config(config, where: str) -> None:
    for name, off in _UNSUPPORTED.items():
        value = getattr(config, name, off)
        if value not in (off, None, False):
            raise NotImplementedError(
                f"graphfp8.lora.{where}: LoraConfig({name}={value!r}) is not supported on "
                "graphfp8 layers (plain LoRA only)"
            )


class LoraLinear(_PeftLoraLinear):
    """peft's LoRA linear layer over a graphfp8.Linear (module docstring)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, **kwargs):
        _check_config(config, type(self).__name__)
        super().__init__(base_layer, adapter_name, config=config, **kwargs)

    def _run_base(self, x: torch.Tensor, args, kwargs):
        """(base output, the tensor the adapters read, what makes the layer's return value of
        the adapted output)."""
        return self.base_layer(x, *args, **kwargs), x, _same

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """x: (..., in_features), as the base layer takes it. Returns (..., out_features)."""
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise NotImplementedError(
                f"graphfp8.lora.{type(self).__name__}: adapter_names (mixed adapter batches) is "
                "not supported"
            )
        if isinstance(x, Float8Tensor):
            raise TypeError(
                f"graphfp8.lora.{type(self).__name__}: the input is a Float8Tensor (the previous "
                "layer's fp8_output=True); the adapters need it in high precision"
            )
        if self.disable_adapters or self.merged:
            if self.disable_adapters and self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result, x, wrap = self._run_base(x, args, kwargs)
        out = result
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            a, b = self.lora_A[name], self.lora_B[name]
            h = self._cast_input_dtype(x, a.weight.dtype)
            out = out + b(a(self.lora_dropout[name](h))) * self.scaling[name]
        return wrap(out.to(result.dtype))

    # Merging: in place (graphs keep reading the same storage), the FP8 weight cache invalidated.

    def _merge_delta(self, names: list[str], sign: int, check: bool = False) -> None:
        weight = self.get_base_layer().weight
        if isinstance(weight, Float8Tensor):
            raise NotImplementedError(
                f"graphfp8.lora.{type(self).__name__}: merging into an FP8 weight "
                "(fp8_model_init) would round the adapter into FP8; keep the adapters separate, "
                "or merge into a high-precision copy"
            )
        delta = sum(self.get_delta_weight(n) for n in names) * sign
        merged = weight.detach() + delta.to(weight.dtype)
        if check and not torch.isfinite(merged).all():
            raise ValueError(f"NaNs detected in the merged weights of adapters {names}")
        with torch.no_grad():
            weight.copy_(merged)
        self.get_base_layer().weight_cache.invalidate("a LoRA merge or unmerge changed them")

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """W += scaling * B @ A for the adapters (all active ones by default), in place; the
        next FP8 forward casts the weight again (is_first_microbatch None or True)."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        names = [n for n in check_adapters_to_merge(self, adapter_names) if n in self.lora_A]
        if names:
            self._merge_delta(names, 1, check=safe_merge)
            self.merged_adapters.extend(names)

    def unmerge(self) -> None:
        """Undoes merge(), in place."""
        names = [n for n in self.merged_adapters if n in self.lora_A]
        if names:
            self._merge_delta(names, -1)
        self.merged_adapters.clear()


class LoraLayerNormLinear(LoraLinear):
    """peft's LoRA over a graphfp8.LayerNormLinear: the adapters read the norm's output (the
    layer computes it anyway; asked for with return_layernorm_output for the call)."""

    def _run_base(self, x: torch.Tensor, args, kwargs):
        base = self.get_base_layer()
        if base.return_layernorm_output or base.fp8_output:
            raise NotImplementedError(
                "graphfp8.lora.LoraLayerNormLinear: a base layer with return_layernorm_output "
                "or fp8_output is not supported"
            )
        base.return_layernorm_output = True
        try:
            result = self.base_layer(x, *args, **kwargs)
        finally:
            base.return_layernorm_output = False
        if kwargs.get("residual") is None:
            return (*result, _same)
        h, (out, ln_out) = result  # TransformerLayer's residual hand-off: (h, output)
        return out, ln_out, lambda y: (h, y)


def _same(y: torch.Tensor) -> torch.Tensor:
    return y


class _RefuseMLP(nn.Module):
    def __init__(self, target: nn.Module, *args, **kwargs):
        raise NotImplementedError(
            "graphfp8.lora: a LayerNormMLP cannot take a LoRA adapter (its two FP8 GEMMs run "
            "inside one fused call); target the attention's qkv and proj layers"
        )


def lora_layers() -> dict[type[nn.Module], type[nn.Module]]:
    """graphfp8's layer classes -> their LoRA layers (peft's custom-module mapping)."""
    return {
        modules.LayerNormLinear: LoraLayerNormLinear,
        modules.Linear: LoraLinear,
        modules.LayerNormMLP: _RefuseMLP,
    }


def register(config):
    """Adds graphfp8's layers to peft's custom LoRA modules of `config` (a peft LoraConfig);
    returns config. Targets are named as usual (target_modules=["qkv", "proj"]). Optional since
    `import graphfp8` puts them in peft's dispatch (graphfp8/lora_dispatch.py); kept for code
    written before."""
    config._register_custom_module(lora_layers())
    return config


def load_hf_adapter(model, adapter_dir: str, adapter_name: str = "default"):
    """A peft model over `model` (a converted Llama / Mistral / Qwen2) carrying the Hugging Face
    adapter that peft saved from the HF model in `adapter_dir`, exactly (graphfp8/lora_hf.py:
    q/k/v_proj fused into qkv at rank n * r with a block-diagonal B); trainable."""
    import peft
    from peft.utils import set_peft_model_state_dict

    config, state = hf_adapter_state(model, adapter_dir)
    peft_model = peft.get_peft_model(model, register(config), adapter_name=adapter_name)
    result = set_peft_model_state_dict(peft_model, state, adapter_name=adapter_name)
    if result.unexpected_keys:
        raise ValueError(f"graphfp8.lora.load_hf_adapter: unexpected keys {result.unexpected_keys}")
    return peft_model
