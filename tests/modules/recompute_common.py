"""A tiny Llama-like language model whose layers recompute (TransformerLayer(recompute=...)), and
the eager training step both recompute tests compare against (tests/modules/test_recompute.py,
tests/graphs/test_recompute_graphs.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import graphfp8 as g8
from tests.graphs.step_common import FFN, HEADS, VOCAB, H, S, adamw

RECIPES = {
    "delayed": g8.DelayedScaling(amax_history_len=4),
    "current": g8.Float8CurrentScaling(),
}
MODES = ("selective", "full")


class RecomputeLM(nn.Module):
    """tokens (B, S) int64 -> logits (B, S, VOCAB): embedding, a SwiGLU/RMSNorm layer (GQA) and a
    GELU/LayerNorm layer, head; the layers' activations recomputed as `recompute` says."""

    def __init__(self, recompute: str = "none", device="cpu", dtype=torch.bfloat16):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H, dtype=dtype, device=device)
        kw = dict(max_seq_len=S, params_dtype=dtype, device=device, recompute=recompute)
        self.blocks = nn.ModuleList([
            g8.TransformerLayer(H, HEADS, FFN, activation="swiglu", normalization="RMSNorm",
                                bias=False, num_gqa_groups=1, **kw),
            g8.TransformerLayer(H, HEADS, FFN, **kw),
        ])  # fmt: skip
        self.head = g8.Linear(H, VOCAB, bias=False, params_dtype=dtype, device=device)

    def forward(self, tokens, is_first_microbatch=None):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, is_first_microbatch=is_first_microbatch)
        return self.head(h, is_first_microbatch=is_first_microbatch)


def pair(mode: str, device):
    """(the model without recompute, its copy recomputing as `mode` says), each with AdamW."""
    torch.manual_seed(0)
    plain = RecomputeLM(device=device)
    recomputed = copy.deepcopy(plain)
    for block in recomputed.blocks:
        block.recompute = mode
    return plain, recomputed, adamw(plain.parameters(), device), adamw(recomputed.parameters(),
                                                                       device)  # fmt: skip
