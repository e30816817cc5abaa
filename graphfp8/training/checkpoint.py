"""graphfp8-train checkpoints: what they hold, writing one, and loading one safely.

    {"format": "graphfp8-train", "version": 1,
     "spec": {"preset", "precision", "model", "seed", "microbatches", "amax_history_len"},
     "steps": the run's length (its LR schedule spans it), "data": the data's description,
     "step": optimizer steps done, "model": the model's state_dict (FP8 amax histories and
     scales in each layer's _extra_state), "optimizer": the AdamW state_dict}

Everything in it is a tensor, a number, a string or a container of them, so it loads with
torch.load(weights_only=True): resuming a checkpoint cannot run code that someone put into it.
A --shard run's checkpoint is a manifest (no "optimizer": each rank's is in its own file, beside
it), written and read by distributed/sharded_checkpoint.py (save_sharded_run, load_sharded_run).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

from graphfp8.distributed.sharded_checkpoint import (
    ShardedCheckpointError,
    load_shard,
    save_sharded,
)
from graphfp8.training.run import OLDER_DEFAULTS, Run

__all__ = ["CheckpointError", "check_resumable", "checkpoint_state", "load_checkpoint",
           "load_sharded_run", "save_checkpoint", "save_sharded_run"]  # fmt: skip

FORMAT, VERSION = "graphfp8-train", 1
_REQUIRED = ("spec", "step", "model", "optimizer")
# What decides the tokens a run trains and validates on (not where the files are).
_DATA_KEYS = ("source", "tokens", "vocab_size", "fingerprint", "seed", "val_fraction")


class CheckpointError(ValueError):
    """A --resume file that is not a graphfp8-train checkpoint, or one of another run."""


def save_checkpoint(run: Run, path: Path, steps: int, data: dict) -> Path:
    """Writes run's state (atomically: a crash leaves the previous file) and returns the path.

    Args:
        run: the run at its current step.
        path: the checkpoint file.
        steps: the run's length (--steps), which its LR schedule spans.
        data: Dataset.describe() of the data it trains on.
    """
    state = checkpoint_state(run.state_dict(), steps, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def checkpoint_state(run_state: dict, steps: int, data: dict) -> dict:
    """What a checkpoint file holds: format and version, a Run.state_dict(), the run's length
    and its data (save_checkpoint's file; without the rank's shards, a --shard run's
    manifest)."""
    return {"format": FORMAT, "version": VERSION, **run_state, "steps": steps, "data": data}


def save_sharded_run(run: Run, path: Path, steps: int, data: dict, group) -> Path:
    """A --shard run's checkpoint: the manifest at `path` and one file per rank (a collective,
    distributed/sharded_checkpoint.py). Raises CheckpointError on every rank if any could not
    write."""

    def header() -> dict:
        state = {k: v for k, v in run.state_dict().items() if k not in ("optimizer", "masters")}
        return checkpoint_state(state, steps, data)

    shard = {"masters": run.masters.state_dict(), "optimizer": run.optimizer.state_dict()}
    try:
        return save_sharded(path, run.step, shard, header, group)
    except ShardedCheckpointError as exc:
        raise CheckpointError(str(exc)) from None


def load_sharded_run(manifest: dict, path: Path, run: Run, group) -> dict:
    """The checkpoint of this rank of a --shard run: the manifest with this rank's "masters" and
    "optimizer", for Run.load_state_dict (a collective). Raises CheckpointError on every rank
    naming each rank's problem."""
    try:
        return load_shard(manifest, path, group,
                          lambda shard: run.masters.check_loadable(shard["masters"]))  # fmt: skip
    except ShardedCheckpointError as exc:
        raise CheckpointError(str(exc)) from None


def _reason(exc: Exception) -> str:
    if isinstance(exc, pickle.UnpicklingError) and "weights_only" in str(exc):
        return "it needs to run code to load, which graphfp8 refuses (weights_only=True)"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:120]}" if first else type(exc).__name__


def load_checkpoint(path: Path) -> dict:
    """Loads a checkpoint onto the CPU with weights_only=True.

    Raises:
        CheckpointError: one line saying why the file is not a graphfp8-train checkpoint.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever the file is, the answer is: not a checkpoint
        raise CheckpointError(f"{path} is not a graphfp8 checkpoint ({_reason(exc)})") from None
    required = [k for k in _REQUIRED if not (k == "optimizer" and _is_manifest(state))]
    if not isinstance(state, dict) or any(k not in state for k in required):
        if isinstance(state, dict):
            held = f"a dict with keys {sorted(map(str, state))[:8]}"
        else:
            held = f"a {type(state).__name__}"
        raise CheckpointError(f"{path} is not a graphfp8 checkpoint (it holds {held})")
    if state.get("format", FORMAT) != FORMAT or state.get("version", VERSION) != VERSION:
        raise CheckpointError(
            f"{path}: format {state.get('format')!r} version {state.get('version')!r}; this "
            f"graphfp8 reads {FORMAT!r} version {VERSION}"
        )
    return state


def _is_manifest(state) -> bool:
    """A --shard checkpoint's manifest (distributed/sharded_checkpoint.py)."""
    return isinstance(state, dict) and isinstance(state.get("shards"), dict)


def check_resumable(state: dict, spec: dict, steps: int, data: dict) -> list[str]:
    """Checks that a checkpoint continues this run: same model, precision and settings, same
    --steps (the LR schedule spans it) and the same data.

    Args:
        state: load_checkpoint()'s result.
        spec: run_settings() of this run.
        steps: this run's --steps.
        data: Dataset.describe() of this run's data.

    Returns:
        Notes to print (an older checkpoint that does not record --steps or its data).

    Raises:
        CheckpointError: naming every setting that differs.
    """
    saved = {**OLDER_DEFAULTS, **state["spec"]}
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {spec[k]!r}"
            for k in spec if saved.get(k) != spec[k]]  # fmt: skip
    notes = []
    if "steps" not in state:
        notes.append("the checkpoint does not record --steps: its LR schedule is assumed to "
                     f"span --steps {steps}")  # fmt: skip
    elif state["steps"] != steps:
        diff.append(f"--steps: checkpoint {state['steps']}, this run {steps} (the LR schedule "
                    f"spans --steps: resume with --steps {state['steps']}; --stop-at ends a run "
                    "early)")  # fmt: skip
    if "data" not in state:
        notes.append("the checkpoint does not record its data: assumed to be this run's")
    else:
        theirs = {k: state["data"].get(k) for k in _DATA_KEYS}
        mine = {k: data.get(k) for k in _DATA_KEYS}
        diff += [f"data {k}: checkpoint {theirs[k]!r}, this run {mine[k]!r}"
                 for k in _DATA_KEYS if theirs[k] != mine[k]]  # fmt: skip
    if diff:
        raise CheckpointError("checkpoint does not match this run: " + "; ".join(diff))
    return notes
