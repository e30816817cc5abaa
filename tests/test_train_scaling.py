"""graphfp8-train --scaling current: Float8CurrentScaling trains, and a checkpoint of one recipe
does not resume a run of the other (graphed == eager: tests/graphs/test_current_scaling_*)."""

from __future__ import annotations

import json

import pytest

from graphfp8 import train

SMALL = ["--batch", "2", "--seq-len", "32", "--microbatches", "2"]


def test_current_scaling_trains(tmp_path):
    argv = [*SMALL, "--device", "cpu", "--steps", "6", "--log-every", "3", "--no-graphs"]
    assert train.main([*argv, "--scaling", "current", "--out", str(tmp_path)]) == 0
    (run,) = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert run["name"] == "fp8-current-eager"
    curve = run["losses"]
    assert curve[-1] < curve[0] - 0.5, f"loss did not go down: {curve}"


def test_resume_rejects_the_other_recipe(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    argv = [*SMALL, "--device", "cpu", "--steps", "2", "--out", str(tmp_path), "--no-graphs"]
    assert train.main([*argv, "--save", str(ckpt), "--scaling", "current"]) == 0
    with pytest.raises(ValueError, match="scaling: checkpoint 'current', this run 'delayed'"):
        train.main([*argv, "--steps", "3", "--resume", str(ckpt)])
