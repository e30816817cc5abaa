"""LoRA adapters in Hugging Face's names (graphfp8/lora_hf.py): an adapter trained on a converted
Llama saved with save_pretrained_hf loads with plain peft onto the plain HF model, and an adapter
trained with peft on the HF model loads onto the converted one with load_hf_adapter; both give
the same logits (FP8 off, fp32 tolerance)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import graphfp8 as g8
import graphfp8.lora as gl

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _models(dtype=torch.float32):
    """(plain HF Llama, converted twin with the same weights), in `dtype`, GQA."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).to(dtype).eval()
    return copy.deepcopy(hf), g8.from_hf(hf).eval()


def _train_step(model, tokens):
    """One AdamW step on the adapters (B starts at 0 in peft: the step makes the adapters act)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-1)
    logits = model(input_ids=tokens).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    with torch.no_grad():  # and random, so each row block of B differs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p), alpha=0.1)


def _logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphfp8_adapter_loads_onto_the_hf_model(tmp_path, dtype):
    """Trained a step in FP8 (fp8_autocast), compared with FP8 off: fp32 tolerance in fp32,
    bf16's in bf16 (the two base models' own difference)."""
    hf, ours = _models(dtype)
    tokens = torch.randint(0, 64, (2, 16))
    base = _logits(hf, tokens)
    base_gap = (_logits(ours, tokens).float() - base.float()).abs().max().item()
    config = gl.register(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj"]))
    lora = peft.get_peft_model(ours, config)
    with g8.fp8_autocast(recipe=g8.DelayedScaling()):
        _train_step(lora, tokens)
    lora.eval()
    want = _logits(lora, tokens)
    assert not torch.allclose(want.float(), base.float(), atol=5e-2)  # the adapter acts
    gl.save_pretrained_hf(lora, tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert sorted(saved["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert saved["r"] == 4 and saved["lora_alpha"] == 8
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path).eval()  # plain peft, no register
    got = _logits(loaded, tokens)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # no further apart than the two bf16 base models are
        assert (got.float() - want.float()).abs().max().item() <= 2 * base_gap


ALL_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("targets", [ALL_ATTENTION, ["q_proj", "v_proj"]])
def test_hf_adapter_loads_onto_the_converted_model(tmp_path, targets):
    """q/k/v stacked into rank n * r with a block-diagonal B; q and v only: rank 2r, k's rows 0."""
    hf, ours = _models()
    tokens = torch.randint(0, 64, (2, 16))
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    _train_step(lora, tokens)
    lora.eval()
    want = _logits(lora, tokens)
    lora.save_pretrained(tmp_path)
    loaded = gl.load_hf_adapter(ours, tmp_path).eval()
    qkv = loaded.base_model.model.layers[0].qkv
    n = len([t for t in targets if t != "o_proj"])
    assert qkv.lora_A["default"].weight.shape[0] == 4 * n and qkv.scaling["default"] == 2.0
    torch.testing.assert_close(_logits(loaded, tokens), want, rtol=1e-5, atol=1e-5)


def test_round_trip_is_bit_for_bit(tmp_path):
    """Saved in HF names and loaded back: the adapters' function is the same tensors' (B split,
    then B block-diagonal: the fused delta B A is equal bit for bit to the original's rows)."""
    _, ours = _models()
    config = gl.register(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj"]))
    lora = peft.get_peft_model(ours, config)
    _train_step(lora, torch.randint(0, 64, (2, 16)))
    gl.save_pretrained_hf(lora, tmp_path)
    qkv = lora.base_model.model.layers[1].qkv
    delta = qkv.get_delta_weight("default")
    _, fresh = _models()
    back = gl.load_hf_adapter(fresh, tmp_path).base_model.model.layers[1].qkv
    sizes = [32, 16, 16]
    for got, ref in zip(back.get_delta_weight("default").split(sizes), delta.split(sizes),
                        strict=True):  # fmt: skip
        assert torch.equal(got, ref)


def test_mlp_adapter_refused(tmp_path):
    hf, ours = _models()
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj"]))
    lora.save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match="LayerNormMLP takes none"):
        gl.load_hf_adapter(ours, tmp_path)
