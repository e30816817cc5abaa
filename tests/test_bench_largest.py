"""`python -m benchmarks.largest_model` (scripts/gpu_check.sh step big: the largest model the
planner fits on one H200, trained) runs end to end at CPU size with the H200 run's flags, and the
planner's choice for the H200 holds >= 6B parameters."""

from __future__ import annotations

import dataclasses
import json
import math

from benchmarks.largest_model import main, planned_layers
from graphfp8.memory.shapes import shape_of


def test_largest_model_flags_run_at_cpu_size(tmp_path):
    assert main(["--out", str(tmp_path), "--preset", "llama-tiny", "--layers", "2",
                 "--seq-len", "64", "--steps", "2", "--device", "cpu"]) == 0  # fmt: skip
    big = json.loads((tmp_path / "big.json").read_text())
    for flag in ("--fp8-weights", "--recompute full", "--graphs layers", "--batch 1"):
        assert flag in big["command"]
    assert big["parameters"] == big["planned_parameters"]  # the planner counts the model's
    assert math.isfinite(big["final_loss"]) and big["max_allocated_bytes"] is None  # CPU


def test_planner_picks_at_least_6b_for_one_h200():
    layers = planned_layers("llama-8b", 8192, "layers")
    assert dataclasses.replace(shape_of("llama-8b"), layers=layers).parameters() >= 6e9
