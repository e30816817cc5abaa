"""graphfp8-train --scaling current and --fp8-weights: runs train, a resume with FP8 primary weights
is bit-exact, and a checkpoint of one recipe does not resume a run of the other (graphed == eager:
tests/graphs/test_current_scaling_graphs.py and test_fp8_primary_graphs.py)."""

from __future__ import annotations

import json
import math

import pytest

from graphfp8 import train
from graphfp8.training.data import make_corpus
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import RunSpec

SMALL = ["--batch", "2", "--seq-len", "32", "--microbatches", "2"]


def test_resume_rejects_the_other_recipe(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    argv = [*SMALL, "--device", "cpu", "--steps", "2", "--out", str(tmp_path), "--no-graphs"]
    assert train.main([*argv, "--save", str(ckpt), "--scaling", "current"]) == 0
    (run,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert run["name"] == "fp8-current-eager" and all(map(math.isfinite, run["losses"]))
    with pytest.raises(ValueError, match="scaling: checkpoint 'current', this run 'delayed'"):
        train.main([*argv, "--steps", "3", "--resume", str(ckpt)])


def test_fp8_weights_resume_is_bit_exact(tmp_path):
    """The whole step as one graph (MasterWeights inside); the checkpoint holds the FP8 weights,
    the fp32 masters and the optimizer state."""
    model = type(PRESETS["tiny"])(**{**PRESETS["tiny"].to_dict(), "batch": 2, "seq_len": 32})
    spec = RunSpec("tiny", model, "fp8", "step", microbatches=2, device="cpu", fp8_weights=True)
    kw = dict(out=tmp_path, corpus=make_corpus(1 << 16), keep_state=True, log_every=2)
    straight = train_run(spec, RunOptions(steps=2, **kw))
    train_run(spec, RunOptions(steps=2, stop_at=1, save=tmp_path / "ckpt.pt", **kw))
    resumed = train_run(spec, RunOptions(steps=2, resume=tmp_path / "ckpt.pt", **kw))
    assert resumed["losses"] == straight["losses"][1:]
    assert straight["losses"][-1] < straight["losses"][0]
    with pytest.raises(ValueError, match="fp8_weights needs precision fp8"):
        RunSpec("tiny", model, "bf16", False, microbatches=2, device="cpu", fp8_weights=True)
