"""Tiny Hugging Face models built from configs (nothing downloaded) and token batches, shared by
the tests of graphfp8.hf and of the frameworks that train it (Trainer, accelerate, Lightning)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8

transformers = pytest.importorskip("transformers")

VOCAB, B, S = 128, 2, 32
RECIPE = g8.DelayedScaling(amax_history_len=4)
GPT2_NO_DROPOUT = dict(embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0)  # graphfp8 runs none
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
           "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel"}  # fmt: skip
KINDS = list(CLASSES)


def config(kind: str, **overrides):
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    if kind == "llama":
        return transformers.LlamaConfig(**{**common, **overrides})
    if kind == "mistral":
        return transformers.MistralConfig(**{**common, "sliding_window": 48, **overrides})
    if kind == "qwen2":  # q, k, v biases; tied embeddings
        return transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    gpt2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                bos_token_id=1, eos_token_id=2, **GPT2_NO_DROPOUT)  # fmt: skip
    return transformers.GPT2Config(**{**gpt2, **overrides})


def hf_model(kind: str = "llama", seed: int = 0, device="cpu", **overrides):
    """The HF model in bf16, eval mode, its biases and norms away from their 0 / 1 init."""
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[kind])(config(kind, **overrides))
    model = model.to(device, torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def ids(seed: int = 1, device="cpu", batch: int = B, seq: int = S) -> torch.Tensor:
    out = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return out.to(device)


def hf_view(lm):
    """An HF model holding exactly lm's weights (to_hf of the model itself)."""
    hf = getattr(transformers, CLASSES[lm.config.model_type])(lm.config).to(torch.bfloat16)
    hf.load_state_dict(g8.to_hf(lm), strict=False)
    return hf.eval()


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of b's largest bf16 rounding step."""
    step = torch.finfo(torch.bfloat16).eps * b.float().abs().max()
    return float((a.float() - b.float()).abs().max() / step)


def batch(step: int, mb: int, device="cpu") -> torch.Tensor:
    """The token batch of one microbatch of a training run (the same in every test run)."""
    return ids(1000 + 10 * step + mb, device)


def train(model, opt, steps: int, start: int = 0, microbatches: int = 2) -> list[torch.Tensor]:
    """Plain training with gradient accumulation and no FP8 code (a carried recipe does FP8);
    returns each microbatch's loss."""
    losses = []
    for step in range(start, start + steps):
        for mb in range(microbatches):
            x = batch(step, mb)
            loss = model(x, labels=x).loss
            (loss / microbatches).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def fp8_model(kind: str = "llama", seed: int = 0, recipe=RECIPE):
    """A converted model carrying `recipe`, in train mode, with an AdamW."""
    lm = g8.from_hf(hf_model(kind, seed).train(), recipe=recipe)
    return lm, torch.optim.AdamW(lm.parameters(), lr=1e-3)


def assert_same_training(a, b, what: str) -> None:
    """Weights, gradients' absence and every FP8 state of two models are equal bit for bit."""
    from graphfp8.testing import assert_bitwise_equal

    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert_bitwise_equal(sb[k], sa[k], f"{what}: {k}")
