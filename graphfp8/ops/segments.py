"""Document boundaries for attention over packed rows: per-token segment ids, the masks they
make, and conversions from TransformerEngine's cu_seqlens and from padding lengths.

A row of a (batch, seq) batch may pack several documents; `segment_ids` (batch, seq) integer, on
the device, gives each token its document: a token attends to the earlier tokens (causal) of
its own segment only. A padding mask is the same with the padding in a segment of its own (it
then attends only to padding, which keeps every softmax row finite; its outputs are not used).
Everything is torch ops on device tensors with static shapes, so a CUDA graph or the CPU tape
captures it; nothing reads the ids on the host.

Positions need not restart per document: RoPE makes q.k depend only on the distance between
the two tokens, and attention never crosses a boundary.

Backends: torch's SDPA takes segment_mask() as its attn_mask; FP8 attention on the CPU masks its
emulation the same way; on the GPU cuDNN runs a ragged graph whose sequences are the runs of equal
ids in each row (graphfp8.ops.cudnn_ragged: at most 16 per row, exact up to that).
"""

from __future__ import annotations

import torch

__all__ = ["segment_ids_from_cu_seqlens", "segment_ids_from_lengths", "segment_mask"]


def segment_mask(segment_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Which key each query may attend to.

    Args:
        segment_ids: (batch, seq) integer segment of each token.
        causal: also forbid later keys.

    Returns:
        (batch, 1, seq, seq) bool, True where attention is allowed (SDPA's attn_mask).
    """
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    if not causal:
        return same
    s = segment_ids.shape[1]
    return same & torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Segment ids of TransformerEngine's "thd" boundaries over the flattened batch.

    Args:
        cu_seqlens: (n + 1,) int32/int64, nondecreasing, cu_seqlens[0] = 0: document i holds the
            flattened tokens [cu_seqlens[i], cu_seqlens[i + 1]) of the batch * seq tokens; tokens
            from cu_seqlens[n] on (if any) form one more segment. A document may run across
            rows: its parts in different rows are separate segments, as rows never attend to
            each other.
        batch, seq: the rows' shape.

    Returns:
        (batch, seq) int64 on cu_seqlens' device.
    """
    tokens = torch.arange(batch * seq, device=cu_seqlens.device)
    ids = torch.searchsorted(cu_seqlens.to(torch.int64), tokens, right=True)
    return ids.view(batch, seq)


def segment_ids_from_lengths(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    """Segment ids of right-padded rows: 0 for the first lengths[b] tokens, 1 for the padding.

    Args:
        lengths: (batch,) integer valid tokens per row (<= seq), on the device.
        seq: the row length.

    Returns:
        (batch, seq) int64.
    """
    positions = torch.arange(seq, device=lengths.device)
    return (positions[None, :] >= lengths.to(torch.int64)[:, None]).to(torch.int64)
