"""Hugging Face's forward arguments as what graphfp8's layers take: attention_mask (padding),
position_ids (packed documents) and a Cache become segment ids, RoPE positions, a mask over the
cached tokens and one KVCache per layer.

    no cache, no RoPE position_ids:  segment_ids (the layers' fused path; graphable)
        attention_mask (B, S) 0/1    -> segment_ids = attention_mask: padding in a segment of
                                        its own (its outputs are not Hugging Face's; its labels
                                        are -100 in HF's collators)
    a cache, or position_ids with RoPE: explicit attention (modules/_explicit_attention.py)
        attention_mask (B, T)        -> (B, 1, 1, T) key mask over the cached and new tokens

position_ids move positions only, as in Hugging Face's sdpa and eager attention: packed documents
(DataCollatorWithFlattening) still attend to each other there; graphfp8's segment_ids keep them
apart. GPT-2's learned positions: position_ids, else restarting at each segment (a packed
document gets the positions it has alone), else past + arange(S).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttentionInputs", "LayerCache", "attention_inputs"]


@dataclass
class AttentionInputs:
    """What every layer of one forward takes (TransformerLayer's keyword arguments)."""

    segment_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None  # RoPE positions (explicit path only)
    attn_mask: torch.Tensor | None = None
    explicit: bool = False

    def layer_kwargs(self, cache, i: int) -> dict:
        kw = {} if self.segment_ids is None else {"segment_ids": self.segment_ids}
        if self.explicit:
            kw.update(position_ids=self.position_ids, attn_mask=self.attn_mask,
                      kv_cache=None if cache is None else LayerCache(cache, i))  # fmt: skip
        return kw


class LayerCache:
    """Layer i's view of a Hugging Face Cache (DynamicCache): the KVCache protocol of
    graphfp8.modules._explicit_attention, (B, G, S, D) as HF stores it."""

    def __init__(self, cache, layer: int):
        self.cache, self.layer = cache, layer

    def length(self) -> int:
        return self.cache.get_seq_length(self.layer)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(k, v, self.layer)


def positions_from_segments(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) positions restarting at 0 at the start of every run of equal segment ids."""
    b, s = segment_ids.shape
    idx = torch.arange(s, device=segment_ids.device).expand(b, s)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - start_idx


def attention_inputs(rope: bool, batch: int, seq: int, past: int, cached: bool, attention_mask,
                     position_ids, segment_ids) -> AttentionInputs:  # fmt: skip
    """The layers' attention arguments for one forward of (batch, seq) new tokens after `past`
    cached ones (module docstring)."""
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
            raise ValueError(
                f"graphfp8.hf: attention_mask must be (batch, tokens) = ({batch}, {past + seq}), "
                f"got {tuple(attention_mask.shape)} (4-D masks are not taken)"
            )
        if segment_ids is not None:
            raise ValueError("graphfp8.hf: give attention_mask or segment_ids, not both")
    explicit = cached or (rope and position_ids is not None)
    if not explicit:
        if segment_ids is None and attention_mask is not None:
            segment_ids = attention_mask.to(torch.int64)
        return AttentionInputs(segment_ids=segment_ids)
    mask = None
    if attention_mask is not None:
        total = past + seq
        if attention_mask.shape[1] != total:
            raise ValueError(f"graphfp8.hf: attention_mask covers {attention_mask.shape[1]} "
                             f"tokens, the cache and the input {total}")  # fmt: skip
        mask = attention_mask.bool()[:, None, None, :]
    return AttentionInputs(segment_ids=segment_ids, position_ids=position_ids, attn_mask=mask,
                           explicit=True)  # fmt: skip


def gpt2_positions(batch: int, seq: int, past: int, position_ids, segment_ids, device):
    """GPT-2's learned-position indices (module docstring)."""
    if position_ids is not None:
        return position_ids
    if segment_ids is not None:
        return positions_from_segments(segment_ids)
    return torch.arange(past, past + seq, device=device).expand(batch, seq)
