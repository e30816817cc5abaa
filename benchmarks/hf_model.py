"""The model of the Hugging Face benchmarks (bench hf, bench hf-users): a LlamaForCausalLM built
from a config (random weights, byte vocabulary), ~100M parameters at FULL."""

from __future__ import annotations

import torch

import graphfp8 as g8

__all__ = ["FULL", "QUICK", "RECIPE", "hf_model"]

RECIPE = g8.DelayedScaling(amax_history_len=16)  # the FP8 peers' recipe
# (hidden, intermediate, layers, heads, kv heads, batch, seq, microbatches, steps)
FULL = (1024, 2816, 9, 16, 4, 8, 1024, 4, 30)
QUICK = (64, 128, 2, 4, 2, 2, 32, 2, 3)


def hf_model(shape, device):
    """The HF Llama of `shape` in bf16, train mode, seed 0 (every peer starts from it)."""
    import transformers

    hidden, inter, layers, heads, kv, _, seq, _, _ = shape
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=seq,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device, torch.bfloat16).train()
