"""Packed documents and padding in cuDNN's FP8 attention: segment ids (graphfp8.ops.segments) as
the ragged ("thd") layout that cuDNN takes, computed on the device with static shapes.

Each run of equal segment ids in a row is one cuDNN sequence: the j-th run of row r is sequence
slot r * SLOTS_PER_ROW + j, and runs past a row's last slot merge into it (their tokens then
attend to each other: a row may hold at most SLOTS_PER_ROW documents, padding included, for the
exact mask of the CPU emulation). Q, K, V, O, dO, dQ, dK, dV keep their BSHD memory; each
sequence's base pointer is displaced by a ragged offset (its first token's element offset), its
length drives cuDNN's padding mask, and the causal mask is top-left within it. A ragged graph's
softmax statistics are (token, head)-major; the forward and backward ops share them as they are.
"""

from __future__ import annotations

import torch

from graphfp8.ops.switches import env_switch

__all__ = ["ENABLED", "SLOTS_PER_ROW", "check_enabled", "declare", "layout", "pack", "slots",
           "stats_desc"]  # fmt: skip

# Off: its first H200 run (2026-12-01) stopped with "an illegal instruction was encountered"
# inside the ragged FP8 forward, and the cuDNN frontend (1.22 on) refuses a ragged FP8 backward on
# Hopper. GRAPHFP8_CUDNN_RAGGED=1 turns it on (graphfp8.modules.attention routes packed batches).
ENABLED = env_switch("CUDNN_RAGGED")


def check_enabled(what: str) -> None:
    """Raises unless the ragged cuDNN path is switched on (FP8 attention with segment ids on a
    GPU): before any kernel, so nothing has changed."""
    if not ENABLED:
        raise NotImplementedError(
            f"{what}: FP8 attention with segment_ids (packed sequences or padding) on the GPU "
            "needs cuDNN's ragged graph, which is switched off: cuDNN has no ragged FP8 "
            "attention backward on Hopper, and its forward stopped with an illegal instruction "
            "on the H200 (graphfp8's layers run such calls with bf16 attention); set "
            "GRAPHFP8_CUDNN_RAGGED=1 to try it on a GPU where cuDNN supports it"
        )


SLOTS_PER_ROW = 16
RAGGED_NAMES = ("seq_len", "offset_q", "offset_kv", "offset_stats")


def slots(batch: int) -> int:
    """Sequence slots of a cuDNN graph for `batch` rows (its batch dimension)."""
    return batch * SLOTS_PER_ROW


def layout(segment_ids: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The ragged layout of segment ids, device tensors only (capturable).

    Args:
        segment_ids: (batch, seq) integer; runs of equal ids are the sequences.
        heads, kv_heads, head_dim: of q (and o) and of k, v.

    Returns:
        {"seq_len": (n, 1, 1, 1), "offset_q", "offset_kv", "offset_stats": (n + 1, 1, 1, 1)}, int32,
        n = slots(batch): each slot's length, and its first token's element offset in q / o,
        in k / v, and in the (token, head)-major statistics.
    """
    b, s = segment_ids.shape
    device = segment_ids.device
    new = torch.ones(b, s, dtype=torch.bool, device=device)
    new[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    local = (new.to(torch.int64).cumsum(1) - 1).clamp(max=SLOTS_PER_ROW - 1)
    slot = local + torch.arange(b, device=device)[:, None] * SLOTS_PER_ROW
    n = slots(b)
    lengths = torch.zeros(n, dtype=torch.int64, device=device)
    lengths.scatter_add_(0, slot.flatten(), torch.ones(b * s, dtype=torch.int64, device=device))
    starts = torch.zeros(n + 1, dtype=torch.int64, device=device)
    starts[1:] = lengths.cumsum(0)

    def as_cudnn(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32).view(-1, 1, 1, 1)

    return {
        "seq_len": as_cudnn(lengths),
        "offset_q": as_cudnn(starts * heads * head_dim),
        "offset_kv": as_cudnn(starts * kv_heads * head_dim),
        "offset_stats": as_cudnn(starts * heads),
    }


def stats_desc(batch: int, seq: int, heads: int, ragged) -> tuple[list[int], list[int]]:
    """(dims, strides) of the softmax statistics of a graph of `batch` (rows or slots):
    (batch, heads, seq, 1), (token, head)-major when ragged (declare()'s result) is given."""
    dims = [batch, heads, seq, 1]
    return dims, ([heads * seq, 1, heads, 1] if ragged else [heads * seq, seq, 1, 1])


def pack(segment_ids, q: torch.Tensor, k: torch.Tensor, first_uid: int) -> dict:
    """{uid: tensor} of layout() for q (batch, seq, heads, d) and k (batch, seq, kv_heads, d),
    uids first_uid, first_uid + 1, ... in RAGGED_NAMES order (as declare() gives them); {}
    without segment ids."""
    if segment_ids is None:
        return {}
    tensors = layout(segment_ids, q.shape[2], k.shape[2], q.shape[3])
    return {first_uid + i: tensors[name] for i, name in enumerate(RAGGED_NAMES)}


def declare(cudnn, graph, key, first_uid: int) -> tuple[dict | None, dict]:
    """The declarations of layout()'s tensors in a graph of `key` (cudnn_sdpa.SdpaKey; uids as
    pack()'s), and the attention op's padding-mask arguments: (None, {}) without segments."""
    if not key.segments:
        return None, {}
    n, out = key.graph_batch, {}
    for i, name in enumerate(RAGGED_NAMES):
        rows = n if name == "seq_len" else n + 1
        out[name] = graph.tensor(uid=first_uid + i, dim=[rows, 1, 1, 1], stride=[1, 1, 1, 1],
                                 data_type=cudnn.data_type.INT32, name=name)  # fmt: skip
    seq_len = out["seq_len"]
    return out, dict(use_padding_mask=True, seq_len_q=seq_len, seq_len_kv=seq_len)
