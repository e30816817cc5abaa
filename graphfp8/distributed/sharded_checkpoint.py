"""Sharded checkpoints (graphfp8-train --shard's, through training/checkpoint.py): a manifest at
the save path and one file per rank, written so that a save interrupted on any rank (a killed
process, a full disk) never leaves a checkpoint that loads half.

    <save>                           the manifest: the caller's header (graphfp8-train: its
                                     checkpoint without "optimizer" and "masters"), plus "shards":
                                     {"world", "token", "files": [[file name, bytes, crc32], ...]
                                     in rank order}
    <save>.<token>.rank<r>-of-<N>    rank r's {"format", "token", "rank", "world", and the
                                     caller's shard (graphfp8-train: "masters", the sharded
                                     MasterWeights.state_dict; "optimizer", this rank's AdamW)}

Saving: every rank writes its file (a temporary file, flushed, then renamed); the ranks exchange
what they wrote or why they could not; only when every rank wrote its file does rank 0 write the
manifest (the same way), then delete the shard files no manifest names. A save that fails or dies
anywhere leaves the previous manifest and the files it names as they were (new files carry a new
token). Loading: the manifest's N must be this run's; every rank checks that every file it names
exists with its size, reads its own (weights_only=True) and checks its crc32, token, rank and N;
the ranks agree before anything loads, and all raise otherwise. The files live beside each other:
every rank must see --save's folder (one node, or a shared file system).
"""

from __future__ import annotations

import os
import re
import secrets
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from graphfp8.distributed.data_parallel import gather_objects

__all__ = ["ShardedCheckpointError", "load_shard", "save_sharded"]

SHARD_FORMAT = "graphfp8-train-shard"
_HEADER = ("format", "token", "rank", "world")  # a shard file's own keys; the rest is the caller's


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint not written or not loadable, raised on every rank."""


def _write(obj, path: Path) -> tuple[int, int]:
    """torch.save to path atomically; returns (bytes, crc32) of the file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size, _crc32(path)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _shard_name(path: Path, token: str, rank: int, world: int) -> str:
    return f"{path.name}.{token}.rank{rank}-of-{world}"


def save_sharded(path: Path, step: int, shard: dict, header: Callable[[], dict], group) -> Path:
    """Writes the manifest and every rank's file (module docstring); a collective. Returns the
    manifest's path.

    Args:
        path: the manifest's path.
        step: the step saved (the start of the files' token).
        shard: what this rank's file holds besides its own keys.
        header: called on group rank 0 once every rank wrote its file: the manifest's contents.

    Raises:
        ShardedCheckpointError: on every rank, naming each rank that could not write (the
            previous checkpoint at `path`, if any, stays whole).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    token = gather_objects(f"{step}-{secrets.token_hex(4)}" if rank == 0 else None, group)[0]
    mine = path.with_name(_shard_name(path, token, rank, world))
    shard = {"format": SHARD_FORMAT, "token": token, "rank": rank, "world": world, **shard}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        outcome = ("ok", mine.name, *_write(shard, mine))
    except OSError as exc:
        outcome = ("error", f"{type(exc).__name__}: {exc}")
    outcomes = gather_objects(outcome, group)
    failed = [f"rank {r}: {o[1]}" for r, o in enumerate(outcomes) if o[0] != "ok"]
    if rank == 0 and not failed:
        manifest = {**header(),
                    "shards": {"world": world, "token": token,
                               "files": [list(o[1:]) for o in outcomes]}}  # fmt: skip
        try:
            _write(manifest, path)
            _remove_unnamed(path, {o[1] for o in outcomes})
        except OSError as exc:
            failed.append(f"rank 0 (the manifest): {type(exc).__name__}: {exc}")
    failed = gather_objects(failed, group)[0]
    if failed:
        mine.unlink(missing_ok=True)
        raise ShardedCheckpointError(f"{path} was not written (the previous checkpoint there, "
                                     f"if any, is intact): " + "; ".join(failed))  # fmt: skip
    return path


def _remove_unnamed(path: Path, named: set[str]) -> None:
    """Deletes the shard files (and leftover temporary files) of `path` that the manifest does
    not name: earlier checkpoints' and interrupted saves'."""
    pattern = re.compile(re.escape(path.name) + r"\.[0-9]+-[0-9a-f]+\.rank[0-9]+-of-[0-9]+(\.tmp)?")
    for f in path.parent.iterdir():
        if pattern.fullmatch(f.name) and f.name not in named:
            f.unlink(missing_ok=True)


def _problem(manifest: dict, path: Path, rank: int, world: int):
    """(this rank's shard, None) or (None, why it cannot load)."""
    shards = manifest["shards"]
    if shards.get("world") != world:
        n = shards.get("world")
        return None, (f"the checkpoint is sharded over {n} ranks, this run has {world}: resume "
                      f"with torchrun --nproc_per_node {n}")  # fmt: skip
    files = shards["files"]
    for name, size, _ in files:
        f = path.with_name(name)
        if not f.is_file() or f.stat().st_size != size:
            return None, f"{f} is missing or not the {size} bytes the manifest names"
    name, _, crc = files[rank]
    f = path.with_name(name)
    if _crc32(f) != crc:
        return None, f"{f} does not match the manifest's crc32 (a changed or damaged file)"
    try:
        shard = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever the file holds, it is not this rank's shard
        return None, f"{f} does not load ({type(exc).__name__})"
    expected = (SHARD_FORMAT, shards["token"], rank, world)
    if (shard.get("format"), shard.get("token"), shard.get("rank"), shard.get("world")) != expected:
        return None, f"{f} is not rank {rank} of {world} of this checkpoint"
    return shard, None


def load_shard(manifest: dict, path: Path, group, check: Callable[[dict], None]) -> dict:
    """The checkpoint of this rank: the manifest with this rank's shard (its file's keys but its
    own). A collective: every rank checks (module docstring), then all agree.

    Args:
        manifest: the manifest, loaded from `path`.
        check: called with this rank's shard before anything loads (a collective, e.g. the
            sharded masters' check_loadable); a ValueError it raises names the problem.

    Raises:
        ShardedCheckpointError: on every rank, naming each rank's problem.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shard, problem = _problem(manifest, path, rank, world)
    problems = [f"rank {r}: {p}" for r, p in enumerate(gather_objects(problem, group)) if p]
    if problems:
        raise ShardedCheckpointError(f"cannot resume {path}: " + "; ".join(problems))
    try:
        check(shard)  # e.g. the masters' layouts, before anything loads
    except ValueError as exc:
        raise ShardedCheckpointError(f"cannot resume {path}: {exc}") from None
    return {**manifest, **{k: v for k, v in shard.items() if k not in _HEADER}}
