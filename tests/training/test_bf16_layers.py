"""graphfp8-train --bf16-layers (Megatron's --first-last-layers-bf16): the listed blocks run in
bf16 inside the FP8 run, eagerly and in both graph modes alike; every block in bf16 is the bf16
run; bad lists are refused before anything runs."""

from __future__ import annotations

import dataclasses

import pytest

from graphfp8.training import cli as train
from graphfp8.training.cli_checks import bf16_layer_indices
from graphfp8.training.data import Dataset
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import RunSpec
from graphfp8.training.sources import open_stream
from tests.training.common import cli_refusal

TINY = dataclasses.replace(PRESETS["tiny"], batch=2, seq_len=32, layers=3)


def _losses(tmp_path, precision, graphs, bf16_layers=()) -> list[float]:
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)
    spec = RunSpec("tiny", TINY, precision, graphs, microbatches=2, device="cpu",
                   bf16_layers=bf16_layers)  # fmt: skip
    out = tmp_path / f"{spec.name}"
    return train_run(spec, RunOptions(steps=2, out=out, data=data, log_every=1,
                                      val_batches=1))["losses"]  # fmt: skip


def test_first_and_last_blocks_in_bf16(tmp_path):
    eager = _losses(tmp_path, "fp8", "none", (0, 2))
    assert _losses(tmp_path, "fp8", "layers", (0, 2)) == eager
    assert _losses(tmp_path, "fp8", "step", (0, 2)) == eager
    assert _losses(tmp_path, "fp8", "none") != eager  # the setting does something
    assert _losses(tmp_path, "fp8", "none", (0, 1, 2)) == _losses(tmp_path, "bf16", "none")


def test_layer_lists():
    assert bf16_layer_indices("first,last", 8) == (0, 7)
    assert bf16_layer_indices("last, 0,3", 8) == (0, 3, 7)
    assert bf16_layer_indices("", 8) == ()
    for bad, match in (("8", "blocks 0 to 7"), ("middle", "first, last or a block index"),
                       ("-1", "first, last")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            bf16_layer_indices(bad, 8)
    with pytest.raises(ValueError, match="bf16_layers needs precision fp8"):
        RunSpec("tiny", TINY, "bf16", "none", microbatches=2, device="cpu", bf16_layers=(0,))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--bf16-layers", "first,9"], "blocks 0 to 1"),
        (["--precision", "bf16", "--bf16-layers", "first"], "--bf16-layers: no run trains in FP8"),
        (["--bf16-layers", "last", "--fp8-weights"], "no bf16 copy"),
    ],
)
def test_cli_refusals(args, message, capsys):
    assert message in cli_refusal(args, capsys)


def test_cli_takes_first_last():
    args = train.parse_args(["--device", "cpu", "--bf16-layers", "first,last"])
    assert args.bf16_layers == (0, PRESETS["tiny"].layers - 1)
