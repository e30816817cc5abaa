"""graphfp8-train --recompute: the losses and final weights of every graph mode equal the run
without recompute bit for bit (the same bits: tests/graphs/test_recompute_graphs.py), and the
run names say it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphfp8.training import cli as train
from graphfp8.training.data import Dataset
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import RunSpec
from graphfp8.training.sources import open_stream

TINY = dataclasses.replace(PRESETS["llama-tiny"], batch=2, seq_len=32)


@pytest.mark.parametrize(
    ("graphs", "fp8_weights"),
    [("none", False), ("layers", False), ("step", False), ("step", True), ("none", True)],
)
def test_recompute_runs_equal_the_run_without(tmp_path, graphs, fp8_weights):
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)
    kw = dict(out=tmp_path, data=data, keep_state=True, log_every=1, val_batches=1)
    results = {}
    for mode in ("none", "selective", "full"):
        spec = RunSpec("llama-tiny", TINY, "fp8", graphs, microbatches=2, device="cpu",
                       recompute=mode, fp8_weights=fp8_weights)  # fmt: skip
        results[mode] = train_run(spec, RunOptions(steps=2, **kw))
    assert spec.name.endswith("-recompute-full") and results["full"]["recompute"] == "full"
    for mode in ("selective", "full"):
        assert results[mode]["losses"] == results["none"]["losses"], mode
        for key, want in results["none"]["model_state"].items():
            assert torch.equal(results[mode]["model_state"][key], want), (mode, key)


def test_recompute_cli(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cpu", "--recompute", "some"])
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cpu", "--recompute", "full", "--compile", "--no-graphs"])
    assert "dynamo cannot trace" in capsys.readouterr().err
    args = train.parse_args(["--device", "cpu", "--recompute", "selective"])
    assert args.recompute == "selective"
