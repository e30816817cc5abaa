"""graphfp8-train's command line: defaults shown, clear one-line errors for bad arguments, bad
data, files that are not checkpoints and checkpoints of another run; weights-only checkpoints."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

import pytest
import torch

import graphfp8 as g8
from graphfp8.training import cli as train
from graphfp8.training.checkpoint import CheckpointError, check_resumable
from graphfp8.training.data import Dataset
from graphfp8.training.run import Run, run_settings
from graphfp8.training.sources import open_stream
from tests.training.common import cli_refusal

SMALL = ["--batch", "2", "--seq-len", "32", "--microbatches", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[pathlib.Path, list[str]]:
    """A 2-step run on the default data, saved; and its arguments."""
    out = tmp_path_factory.mktemp("run")
    argv = [*SMALL, "--steps", "2", "--val-batches", "1", "--out", str(out)]
    assert train.main([*argv, "--save", str(out / "ckpt.pt")]) == 0
    return out / "ckpt.pt", argv


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("graphfp8-train: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare", "fp16"], "bad run 'fp16'"),
        (["--compare", "fp8:graph"], "bad run 'fp8:graph'"),
        (["--compare", "fp8,fp8"], "listed twice"),
        (["--seq-len", "20"], "multiple of 16"),
        (["--steps", "0"], "must be >= 1"),
        (["--steps", "abc"], "argument --steps: expected a whole number >= 1, got 'abc'"),
        (["--val-fraction", "1.5"], "must be in [0, 1), got 1.5"),
        (["--device", "tpu"], "--device tpu: graphfp8-train runs on cpu or cuda"),
        (["--steps", "12", "--stop-at", "13"], "--stop-at 13 is beyond --steps 12"),
        (["--resume", "/nonexistent/ckpt.pt"], "no checkpoint"),
        (["--compare", "--save", "x.pt"], "single run"),
        (["--precision", "fp4"], "invalid choice"),
    ],
)
def test_bad_arguments(args, message, capsys):
    err = cli_refusal(args, capsys)
    assert message in err and "Traceback" not in err, err


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    options = re.split(r"\n  (?=-)", text)[1:]
    assert len(options) == len(train.build_parser()._actions)
    for option in options:
        if not option.startswith("-h,"):
            assert "(default: " in " ".join(option.split()), option


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_device_without_gpu(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cuda"])
    assert "no CUDA GPU" in capsys.readouterr().err


def test_ddp_without_torchrun(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cpu", "--ddp"])
    assert "runs under torchrun" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/nonexistent/text"], "--data /nonexistent/text: no such file or folder"),
        (["--data", "{short}"], "--seq-len 32: a sequence needs 33 tokens, the training part"),
        (["--data", "{short}.bin", "--vocab-size", "9"], "not a whole number of uint16 tokens"),
    ],
)
def test_bad_data_is_one_line(args, message, tmp_path, capsys):
    (tmp_path / "short").write_bytes(b"print('hello')\n")
    (tmp_path / "short.bin").write_bytes(b"\x01\x00\x02")
    args = [a.format(short=tmp_path / "short") for a in args]
    assert train.main([*SMALL, *args]) == 2
    assert message in _one_line_error(capsys)


def test_checkpoint_is_weights_only(checkpoint):
    state = torch.load(checkpoint[0], weights_only=True)
    assert (state["format"], state["version"], state["step"], state["steps"]) == (
        "graphfp8-train", 1, 2, 2)  # fmt: skip
    assert state["data"]["source"] == "stdlib" and state["spec"]["precision"] == "fp8"


class _RunsCode:
    """Unpickling this creates a file: what a checkpoint must never be able to do."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def _not_checkpoints(path: pathlib.Path, real: pathlib.Path, kind: str) -> None:
    if kind == "truncated":
        path.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(os.urandom(4096))
    elif kind == "foreign":
        torch.save({"weights": torch.ones(3)}, path)
    elif kind == "code":
        torch.save({"spec": _RunsCode(path.with_suffix(".ran"))}, path)


@pytest.mark.parametrize("kind", ["truncated", "empty", "random", "foreign", "code"])
def test_resume_refuses_what_is_not_a_checkpoint(checkpoint, tmp_path, kind, capsys):
    real, argv = checkpoint
    path = tmp_path / "bad.pt"
    _not_checkpoints(path, real, kind)
    assert train.main([*argv, "--resume", str(path)]) == 2
    assert f"{path} is not a graphfp8 checkpoint" in _one_line_error(capsys)
    assert not path.with_suffix(".ran").exists(), "loading the checkpoint ran its code"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--precision", "bf16"], "precision: checkpoint 'fp8', this run 'bf16'"),
        (["--steps", "4"], "--steps: checkpoint 2, this run 4 (the LR schedule spans --steps"),
        (["--val-fraction", "0.02"], "data val_fraction: checkpoint 0.01, this run 0.02"),
        (["--compile"], "compile: checkpoint False, this run True"),  # issue 39: accepted
        ([], "the checkpoint is at step 2: --steps 2 (stop at 2) leaves nothing to train"),
    ],
)
def test_resume_refuses_another_run(checkpoint, args, message, capsys):
    real, argv = checkpoint
    capsys.readouterr()
    assert train.main([*argv, "--resume", str(real), *args]) == 2
    assert message in _one_line_error(capsys)


def test_older_checkpoints_resume_with_a_note():
    """A checkpoint of the previous format (no --steps, no data) is accepted, saying what it
    cannot check; settings are still compared."""
    settings = {"preset": "tiny", "precision": "fp8", "seed": 0}
    data = {"source": "stdlib", "tokens": 10, "val_fraction": 0.01}
    old = {"spec": settings, "step": 3, "model": {}, "optimizer": {}}
    notes = check_resumable(old, settings, 12, data)
    assert len(notes) == 2 and "--steps 12" in notes[0] and "data" in notes[1]
    assert check_resumable({**old, "steps": 12, "data": data}, settings, 12, data) == []
    with pytest.raises(CheckpointError, match="seed: checkpoint 0, this run 1; --steps: "):
        check_resumable({**old, "steps": 12}, {**settings, "seed": 1}, 24, data)


def test_older_checkpoints_trained_hybrid():
    """Checkpoints from before --fp8-format record no format: they trained HYBRID, so they
    resume a HYBRID run and refuse an E4M3 one."""
    settings = {"preset": "tiny", "precision": "fp8", "seed": 0}
    data = {"source": "stdlib", "tokens": 10, "val_fraction": 0.01}
    old = {"spec": settings, "step": 3, "steps": 12, "data": data, "model": {}, "optimizer": {}}
    assert check_resumable(old, {**settings, "fp8_format": "HYBRID"}, 12, data) == []
    with pytest.raises(CheckpointError, match="fp8_format: checkpoint 'HYBRID', this run 'E4M3'"):
        check_resumable(old, {**settings, "fp8_format": "E4M3"}, 12, data)


def test_fp8_format_reaches_the_recipe():
    args = train.parse_args(["--device", "cpu", "--fp8-format", "E4M3", "--data", "synthetic"])
    spec = train._spec(args, "fp8", "none", 256)
    assert spec.name == "fp8-e4m3-eager" and run_settings(spec)["fp8_format"] == "E4M3"
    assert train._spec(args, "bf16", "none", 256).name == "bf16-eager"
    data = Dataset(open_stream("synthetic", synthetic_bytes=1 << 16))
    assert Run(spec, data).recipe.fp8_format is g8.Format.E4M3
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cpu", "--fp8-format", "E5M2"])
    with pytest.raises(ValueError, match="fp8_format must be one of"):
        dataclasses.replace(spec, fp8_format="E5M2")
