"""graphfp8-train --scaling current / blockwise and --fp8-weights: runs train, a resume with FP8
primary weights (the whole step as one graph) is bit-exact, and a checkpoint of one recipe does
not resume a run of the other (graphed == eager: tests/graphs/test_current_scaling_graphs.py and
test_fp8_primary_graphs.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from graphfp8.training import cli as train
from graphfp8.training.data import Dataset
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import RunSpec
from graphfp8.training.sources import open_stream

SMALL = ["--batch", "2", "--seq-len", "32", "--microbatches", "2", "--device", "cpu",
         "--data", "synthetic", "--val-batches", "1"]  # fmt: skip
TINY = dataclasses.replace(PRESETS["tiny"], batch=2, seq_len=32)


def test_resume_refuses_the_other_recipe(tmp_path, capsys):
    ckpt = tmp_path / "ckpt.pt"
    argv = [*SMALL, "--steps", "3", "--out", str(tmp_path), "--no-graphs"]
    assert train.main([*argv, "--stop-at", "2", "--save", str(ckpt), "--scaling", "current"]) == 0
    (run,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert run["name"] == "fp8-current-eager" and all(map(math.isfinite, run["losses"]))
    capsys.readouterr()
    assert train.main([*argv, "--resume", str(ckpt)]) == 2
    assert "scaling: checkpoint 'current', this run 'delayed'" in capsys.readouterr().err


def test_fp8_weights_resume_is_bit_exact(tmp_path):
    """The whole step as one graph (MasterWeights inside); the checkpoint holds the FP8 weights,
    the fp32 masters and the optimizer state."""
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)
    spec = RunSpec("tiny", TINY, "fp8", "step", microbatches=2, device="cpu", fp8_weights=True)
    assert spec.name == "fp8-fp8w-step"
    kw = dict(out=tmp_path, data=data, keep_state=True, log_every=1, val_batches=1)
    straight = train_run(spec, RunOptions(steps=2, **kw))
    train_run(spec, RunOptions(steps=2, stop_at=1, save=tmp_path / "ckpt.pt", **kw))
    resumed = train_run(spec, RunOptions(steps=2, resume=tmp_path / "ckpt.pt", **kw))
    assert resumed["losses"] == straight["losses"][1:]
    assert straight["losses"][-1] < straight["losses"][0]
    with pytest.raises(ValueError, match="fp8_weights needs precision fp8"):
        RunSpec("tiny", TINY, "bf16", False, microbatches=2, device="cpu", fp8_weights=True)


def test_blockwise_runs_train(tmp_path):
    """--scaling blockwise eagerly, with per-layer graphs and as one step graph: the same
    losses bit for bit, and they fall."""
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)
    losses = {}
    for graphs in ("none", "layers", "step"):
        spec = RunSpec("tiny", TINY, "fp8", graphs, microbatches=2, device="cpu",
                       scaling="blockwise")  # fmt: skip
        assert spec.name.startswith("fp8-block-")
        options = RunOptions(steps=3, out=tmp_path / graphs, data=data, log_every=1,
                             val_batches=1)  # fmt: skip
        losses[graphs] = train_run(spec, options)["losses"]
    assert all(map(math.isfinite, losses["none"])) and losses["none"][-1] < losses["none"][0]
    assert losses["layers"] == losses["none"] and losses["step"] == losses["none"]


def test_blockwise_fp8_weights_run_and_resume_bit_exact(tmp_path):
    """--scaling blockwise --fp8-weights: weights stored in 128x128 blocks, trained through fp32
    MasterWeights; eager and the step graph give the same losses, and a resume of the step graph
    continues bit for bit (the checkpoint holds the blocks, the masters, the optimizer)."""
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)
    kw = dict(data=data, keep_state=True, log_every=1, val_batches=1)
    runs = {}
    for graphs in ("none", "step"):
        spec = RunSpec("tiny", TINY, "fp8", graphs, microbatches=2, device="cpu",
                       scaling="blockwise", fp8_weights=True)  # fmt: skip
        assert spec.name == f"fp8-block-fp8w-{'eager' if graphs == 'none' else graphs}"
        runs[graphs] = train_run(spec, RunOptions(steps=2, out=tmp_path / graphs, **kw))
    assert runs["step"]["losses"] == runs["none"]["losses"]
    assert all(map(math.isfinite, runs["none"]["losses"]))
    train_run(spec, RunOptions(steps=2, stop_at=1, save=tmp_path / "ckpt.pt", out=tmp_path, **kw))
    resumed = train_run(spec, RunOptions(steps=2, resume=tmp_path / "ckpt.pt", out=tmp_path, **kw))
    assert resumed["losses"] == runs["step"]["losses"][1:]
    with pytest.raises(ValueError, match="under fsdp is not supported"):
        RunSpec("tiny", TINY, "fp8", "none", microbatches=2, device="cpu", scaling="blockwise",
                fp8_weights=True, fsdp=True)  # fmt: skip
