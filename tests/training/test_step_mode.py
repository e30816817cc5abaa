"""graphfp8-train --graphs step (the whole training step as one graph) on the CPU tape: the same
losses as eager and per-layer graphs, a bit-exact resume, the flags, and the profile runner."""

from __future__ import annotations

import json

import pytest
import torch

from graphfp8.testing import assert_bitwise_equal
from graphfp8.training import cli as train
from graphfp8.training import step_profile as profile_runner
from graphfp8.training.data import Dataset
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import RunSpec
from graphfp8.training.sources import open_stream

# The tiny preset on every device: the CLI's default on CUDA is 100m, whose first steps at its
# full learning rate (a 3-step schedule has a 1-step warm-up) on 64-token microbatches raise the
# loss, eager as much as graphed, on the CPU as on the GPU (measured on the former embedded
# corpus: 5.91, 5.62, 9.74 in bf16 on the CPU; 9.73 with float32 parameters; 4.89 with the rate
# ramped over 10 steps).
SMALL = ["--preset", "tiny", "--batch", "2", "--seq-len", "32", "--microbatches", "2",
         "--data", "synthetic", "--val-batches", "1"]  # fmt: skip


def test_step_graph_trains_like_eager(device, tmp_path):
    """Whole step graphed == eager, bit for bit (eager == per-layer graphs: test_runs.py), and
    the loss falls over 3 steps."""
    argv = [*SMALL, "--device", device, "--steps", "3", "--log-every", "3", "--out", str(tmp_path)]
    assert train.main([*argv, "--compare", "fp8:eager,fp8:step"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    losses = {r["name"]: r["losses"] for r in summary["runs"]}
    assert losses["fp8-step"] == losses["fp8-eager"]
    assert losses["fp8-step"][-1] < losses["fp8-step"][0]
    assert {r["name"]: r["graphs"] for r in summary["runs"]}["fp8-step"] == "step"


def test_resume_with_step_graph_is_bit_exact(tmp_path):
    model = type(PRESETS["tiny"])(**{**PRESETS["tiny"].to_dict(), "batch": 2, "seq_len": 32})
    spec = RunSpec("tiny", model, "fp8", "step", microbatches=2, device="cpu")
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)
    kw = dict(out=tmp_path, data=data, keep_state=True, log_every=2, val_batches=1)
    straight = train_run(spec, RunOptions(steps=2, **kw))
    train_run(spec, RunOptions(steps=2, stop_at=1, save=tmp_path / "ckpt.pt", **kw))
    resumed = train_run(spec, RunOptions(steps=2, resume=tmp_path / "ckpt.pt", **kw))
    assert resumed["losses"] == straight["losses"][1:]
    for name, value in straight["model_state"].items():
        if isinstance(value, torch.Tensor):
            assert_bitwise_equal(resumed["model_state"][name], value, name)


@pytest.mark.parametrize(
    "args, graphs, runs",
    [
        ([], "layers", [("fp8", "layers")]),
        (["--graphs"], "layers", [("fp8", "layers")]),
        (["--graphs", "step"], "step", [("fp8", "step")]),
        (["--no-graphs"], "none", [("fp8", "none")]),
        (["--graphs", "step", "--compare", "bf16,fp8:graphs,fp8:eager"], "step",
         [("bf16", "step"), ("fp8", "layers"), ("fp8", "none")]),
    ],
)  # fmt: skip
def test_graph_mode_flags(args, graphs, runs):
    parsed = train.parse_args(["--device", "cpu", *args])
    assert (parsed.graphs, parsed.runs) == (graphs, runs)


def test_bad_graph_mode(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cpu", "--graphs", "all"])
    assert "invalid choice: 'all'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="graphs must be one of"):
        RunSpec("tiny", PRESETS["tiny"], "fp8", "blocks", microbatches=1, device="cpu")


def test_profile_runner_takes_the_graph_mode():
    """(The runner itself runs in test_profile.py; the step graph's profile runs on the GPU.)"""
    assert profile_runner._parse(["--device", "cpu", "--graphs", "step"]).graphs == "step"
    assert profile_runner._parse(["--device", "cpu", "--no-graphs"]).graphs == "none"
