"""graphfp8-train --ddp --shard (train.main on the rank pool's 2 or 3 gloo ranks, as torchrun would
start it): eager, layers and step graphs give the same losses, the ranks agree, every rank's
memory is in the summary; --save writes a manifest and a file per rank and --resume continues bit
for bit; a save that fails on one rank leaves the previous checkpoint whole, and a checkpoint of
another N or with a missing file is refused on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from graphfp8.distributed import sharded_checkpoint as shard_checkpoint
from tests.rank_pool import run_on_ranks
from tests.sharding.common import run_cli
from tests.training.common import cli_refusal

ARGS = ["--device", "cpu", "--ddp", "--shard", "--fp8-weights", "--batch", "2", "--seq-len", "32",
        "--microbatches", "2", "--data", "synthetic", "--val-batches", "1", "--log-every",
        "2"]  # fmt: skip


def _summary(out: str) -> dict:
    return json.loads((Path(out) / "summary.json").read_text())


def _every_mode(rank, device, tmp):
    losses = {}
    for mode in ("none", "layers", "step"):
        out = f"{tmp}/{mode}"
        code, stdout, err = run_cli([*ARGS, "--graphs", mode, "--steps", "4", "--out", out])
        assert code == 0, err
        if rank != 0:
            continue
        run = _summary(out)["runs"][0]
        assert run["name"].startswith("fp8-fp8w-") and run["name"].endswith("-shard")
        assert run["ranks_agree"] == {"fp8_state": True, "parameters": True, "val_loss": True}
        memory = run["memory_per_rank"]
        assert [m["rank"] for m in memory] == [0, 1]
        state = [m["state"]["bytes"] for m in memory]
        # Each rank holds about half of the masters and their Adam moments (the embedding's
        # and the head's slices differ in size).
        total = sum(s["fp32 masters"] for s in state)
        assert all(0.3 < s["fp32 masters"] / total < 0.7 for s in state)
        assert all(s["optimizer state"] >= 2 * s["fp32 masters"] for s in state)
        assert "B/param of state" in stdout
        losses[mode] = run["losses"]
    if rank == 0:
        assert losses["none"] == losses["layers"] == losses["step"], losses
        assert losses["none"][-1] < losses["none"][0]


def test_every_graph_mode_trains_the_same(tmp_path):
    run_on_ranks("gloo", _every_mode, str(tmp_path))


def _save_resume(rank, device, tmp):
    ckpt = f"{tmp}/ckpt.pt"
    code, _, err = run_cli([*ARGS, "--steps", "6", "--out", f"{tmp}/straight"])
    assert code == 0, err
    code, _, err = run_cli([*ARGS, "--steps", "6", "--stop-at", "3", "--save", ckpt, "--out",
                            f"{tmp}/half"])  # fmt: skip
    assert code == 0, err
    dist.barrier()
    files = sorted(p.name for p in Path(tmp).glob("ckpt.pt*"))
    assert len(files) == 3 and files[0] == "ckpt.pt", files  # the manifest and 2 shards
    # A save that fails on rank 1 (a full disk) leaves the checkpoint above whole.
    write = shard_checkpoint._write
    if rank == 1:
        shard_checkpoint._write = _no_space
    try:
        code, _, err = run_cli([*ARGS, "--steps", "6", "--stop-at", "3", "--save", ckpt, "--out",
                                f"{tmp}/failed"])  # fmt: skip
    finally:
        shard_checkpoint._write = write
    assert code == 2 and "rank 1: OSError: [Errno 28] No space left on device" in err, err
    dist.barrier()  # rank 0 has removed the shard it wrote
    assert sorted(p.name for p in Path(tmp).glob("ckpt.pt*")) == files
    code, _, err = run_cli([*ARGS, "--steps", "6", "--resume", ckpt, "--out", f"{tmp}/resumed"])
    assert code == 0, err
    if rank == 0:
        straight = _summary(f"{tmp}/straight")["runs"][0]["losses"]
        assert _summary(f"{tmp}/half")["runs"][0]["losses"] == straight[:3]
        assert _summary(f"{tmp}/resumed")["runs"][0]["losses"] == straight[3:]


def _no_space(obj, path):
    raise OSError(28, "No space left on device")


def test_save_and_resume_per_rank_files(tmp_path):
    run_on_ranks("gloo", _save_resume, str(tmp_path))


def _refused(rank, device, tmp):
    ckpt = f"{tmp}/ckpt.pt"
    code, _, err = run_cli([*ARGS, "--steps", "6", "--resume", ckpt, "--out", f"{tmp}/n3"])
    assert code == 2 and "sharded over 2 ranks, this run has 3" in err, err


def _missing_file(rank, device, tmp):
    ckpt = f"{tmp}/ckpt.pt"
    code, _, err = run_cli([*ARGS, "--steps", "6", "--stop-at", "2", "--save", ckpt, "--out",
                            f"{tmp}/save"])  # fmt: skip
    assert code == 0, err
    dist.barrier()
    if rank == 1:
        next(Path(tmp).glob("ckpt.pt.*.rank1-of-2")).unlink()
    dist.barrier()
    code, _, err = run_cli([*ARGS, "--steps", "6", "--resume", ckpt, "--out", f"{tmp}/resume"])
    assert code == 2 and "rank1-of-2 is missing" in err, err


def test_a_checkpoint_of_another_n_or_a_missing_file_is_refused(tmp_path):
    run_on_ranks("gloo", _missing_file, str(tmp_path))
    run_on_ranks("gloo", _refused, str(tmp_path), world=3)


@pytest.mark.parametrize("argv", [["--shard"]])
def test_shard_needs_ddp(argv, capsys):
    assert "--shard shards over the ranks of --ddp" in cli_refusal(argv, capsys)
