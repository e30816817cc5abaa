"""graphfp8-train's outputs (issue 25): --out and --save checked at start with one-line errors
(they failed after training, or with a pathlib traceback), a second run into the same --out
writes into a fresh subfolder and says so (it overwrote the first), and Ctrl-C stops at a step
boundary, writes the checkpoint and summary.json of what finished, and says so."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from graphfp8.training import cli as train
from graphfp8.training import run as run_module
from graphfp8.training.checkpoint import load_checkpoint

FAST = ["--batch", "2", "--seq-len", "32", "--microbatches", "1", "--device", "cpu",
        "--val-batches", "1", "--log-every", "1"]  # fmt: skip


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("graphfp8-train: error: "), err
    return lines[0]


def _refused_at_start(monkeypatch):
    """Fails the test if a training step runs."""

    def no_step(self, total):
        raise AssertionError("trained before refusing its outputs")

    monkeypatch.setattr(run_module.Run, "train_step", no_step)


@pytest.mark.parametrize(
    "case, message",
    [
        ("save under a file", r"--save .*/file/ckpt.pt: .*/file is a file, not a folder"),
        ("save is a folder", "is a folder; --save names the checkpoint file"),
        ("out is a file", "is a file; --out names a folder"),
        ("out under a file", r"--out .*/file/logs: cannot write in .*/file/logs"),
    ],
)
def test_unwritable_outputs_are_refused_at_start(case, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    out, save = tmp_path / "out", None
    if case == "save under a file":
        save = tmp_path / "file" / "ckpt.pt"
    elif case == "save is a folder":
        save = tmp_path
    elif case == "out is a file":
        out = tmp_path / "file"
    else:
        out = tmp_path / "file" / "logs"
    _refused_at_start(monkeypatch)
    argv = [*FAST, "--steps", "2", "--out", str(out)] + (["--save", str(save)] if save else [])
    assert train.main(argv) == 2
    assert re.search(message, _one_line_error(capsys))
    assert not list(tmp_path.glob("**/*.csv"))


def test_a_second_run_into_the_same_out_writes_a_fresh_subfolder(tmp_path, capsys):
    argv = [*FAST, "--steps", "1", "--no-graphs", "--precision", "bf16", "--out", str(tmp_path)]
    assert train.main(argv) == 0
    first = (tmp_path / "summary.json").read_text()
    capsys.readouterr()
    assert train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"note: --out {tmp_path} holds an earlier run (bf16-eager.csv, summary.json); this " \
           "run writes to" in out  # fmt: skip
    assert (tmp_path / "summary.json").read_text() == first, "the first run was overwritten"
    [fresh] = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (fresh / "summary.json").is_file() and (fresh / "bf16-eager.csv").is_file()


def _ctrl_c_after(monkeypatch, step: int, times: int = 1):
    """Sends this process SIGINT (`times` in a row) at the end of training step `step`."""
    real = run_module.Run.train_step

    def train_step(self, total):
        loss = real(self, total)
        if self.step == step:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return loss

    monkeypatch.setattr(run_module.Run, "train_step", train_step)


def test_ctrl_c_writes_the_checkpoint_and_summary_of_what_finished(tmp_path, capsys, monkeypatch):
    _ctrl_c_after(monkeypatch, step=2)
    ckpt = tmp_path / "ckpt.pt"
    argv = [*FAST, "--steps", "6", "--out", str(tmp_path), "--save", str(ckpt)]
    assert train.main(argv) == 130
    captured = capsys.readouterr()
    assert "stopping after this step" in captured.err
    assert "interrupted: fp8-graphs stopped after step 2 of 6; resume with --resume" in captured.out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] is True
    [run] = summary["runs"]
    assert run["steps"] == 2 and len(run["losses"]) == 2 and run["interrupted"] is True
    assert load_checkpoint(ckpt)["step"] == 2
    # It resumes: the checkpoint is of a finished step.
    monkeypatch.undo()
    resumed = [*FAST, "--steps", "6", "--out", str(tmp_path / "resumed"), "--resume", str(ckpt)]
    assert train.main(resumed) == 0


def test_a_second_ctrl_c_aborts_without_writing(tmp_path, capsys, monkeypatch):
    _ctrl_c_after(monkeypatch, step=1, times=2)
    ckpt = tmp_path / "ckpt.pt"
    argv = [*FAST, "--steps", "4", "--no-graphs", "--out", str(tmp_path), "--save", str(ckpt)]
    assert train.main(argv) == 130
    assert "stopped without writing a checkpoint or summary.json" in capsys.readouterr().err
    assert not ckpt.exists() and not (tmp_path / "summary.json").exists()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "handler restored"
