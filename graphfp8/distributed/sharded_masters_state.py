"""Checkpoints of sharded masters (distributed/sharded_masters.py): each rank's shard with the
layout it belongs to, the check before a load writes anything (on every rank at once), and the
consolidated fp32 masters on rank 0 for export. Each function takes the masters' buffers
(layout: ShardLayout; shards: this rank's fp32 master slice per bucket; scale: the FP8 weights'
quantization scales), not the masters: this module is below them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from graphfp8.distributed.collectives import all_gather_
from graphfp8.distributed.shard_layout import ShardLayout

__all__ = ["check_loadable", "full_state", "shard_state"]


def shard_state(layout: ShardLayout, shards: list[torch.Tensor], scale: torch.Tensor) -> dict:
    """{"layout": ShardLayout.describe(), "masters": [fp32 slice per bucket], "scales": the FP8
    weights' quantization scales (kept when a weight's amax is 0)}."""
    return {
        "layout": layout.describe(),
        "masters": [m.detach().clone() for m in shards],
        "scales": scale.detach().clone(),
    }


def _text(layout: dict) -> str:
    buckets = layout["buckets"]
    entries = sum(len(b["entries"]) for b in buckets)
    return (f"rank {layout['rank']} of {layout['world']} ({len(buckets)} buckets, {entries} "
            f"parameters)")  # fmt: skip


def _first_difference(saved: dict, mine: dict) -> str:
    """The first place two layouts differ, in words."""
    for key in ("world", "rank", "align"):
        if saved.get(key) != mine[key]:
            return f"{key} {saved.get(key)!r} vs {mine[key]!r}"
    for b, (sb, mb) in enumerate(zip(saved["buckets"], mine["buckets"], strict=False)):
        if sb["shard"] != mb["shard"]:
            return f"bucket {b}: slices of {sb['shard']} vs {mb['shard']} elements"
        for se, me in zip(sb["entries"], mb["entries"], strict=False):
            if se != me:
                return f"bucket {b}: {se} vs {me}"
        if len(sb["entries"]) != len(mb["entries"]):
            return f"bucket {b}: {len(sb['entries'])} vs {len(mb['entries'])} parameters"
    return f"{len(saved['buckets'])} vs {len(mine['buckets'])} buckets"


def _problem(layout: ShardLayout, shards: list[torch.Tensor], scale: torch.Tensor,
             state) -> str | None:  # fmt: skip
    """Why `state` cannot load into these buffers on this rank, or None."""
    if not isinstance(state, dict) or not {"layout", "masters", "scales"} <= set(state):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        return (f"not a sharded masters' state_dict (keys {got}); a full_state_dict() loads "
                "into an unsharded MasterWeights")  # fmt: skip
    mine = layout.describe()
    saved = state["layout"]
    if saved != mine:
        return (f"the checkpoint holds the shard of {_text(saved)}, this run is {_text(mine)}: "
                f"{_first_difference(saved, mine)}")  # fmt: skip
    for b, (t, m) in enumerate(zip(state["masters"], shards, strict=False)):
        if not torch.is_tensor(t) or t.dtype != torch.float32 or t.shape != m.shape:
            return f"bucket {b}'s masters are not a float32 {tuple(m.shape)} tensor"
    if len(state["masters"]) != len(shards):
        return f"{len(state['masters'])} buckets of masters, the layout has {len(mine['buckets'])}"
    scales = state["scales"]
    if not torch.is_tensor(scales) or scales.shape != scale.shape:
        return f"the scales are not a {tuple(scale.shape)} tensor"
    return None


def check_loadable(layout: ShardLayout, shards: list[torch.Tensor], scale: torch.Tensor, group,
                   state) -> None:  # fmt: skip
    """Raises on every rank of the group, naming each rank's problem, unless every rank's
    `state` loads (a collective: all_gather_object of the verdicts)."""
    problem = _problem(layout, shards, scale, state)
    verdicts: list = [None] * layout.world
    dist.all_gather_object(verdicts, problem, group=group)
    bad = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if bad:
        raise ValueError(
            "MasterWeights.load_state_dict (sharded): nothing was loaded: "
            + "; ".join(f"rank {r}: {v}" for r, v in bad)
        )


@torch.no_grad()
def full_state(layout: ShardLayout, shards: list[torch.Tensor], group) -> dict | None:
    """Every bucket's masters all-gathered (one bucket at a time), cut into parameters on group
    rank 0. A collective; None on the other ranks."""
    fp8, hp = {}, {}
    for bucket, shard in zip(layout.buckets, shards, strict=True):
        flat = torch.empty(bucket.padded(layout.world), dtype=torch.float32, device=shard.device)
        all_gather_(flat, shard, group)
        if layout.rank != 0:
            continue
        for e in bucket.entries:
            out = fp8 if e.fp8_dtype is not None else hp
            out[e.name] = flat[e.offset : e.stop].view(e.shape).clone()
    return {"masters": fp8, "hp_masters": hp} if layout.rank == 0 else None
