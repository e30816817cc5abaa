"""graphfp8-train's runs on the CPU: losses go down, graphed == eager (training and validation),
validation changes no state, bit-exact resume, logs and plot written, data parallel."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphfp8.testing import assert_bitwise_equal
from graphfp8.training import cli as train
from graphfp8.training.data import Dataset
from graphfp8.training.evaluate import validation_loss
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream

SMALL = ["--batch", "2", "--seq-len", "32", "--microbatches", "2"]
TINY = dataclasses.replace(PRESETS["tiny"], batch=2, seq_len=32)


@pytest.fixture(scope="module")
def synthetic() -> Dataset:
    return Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)


def test_compare_trains_graphed_equal_to_eager_and_writes_logs(device, tmp_path, capsys):
    runs = "bf16:eager,bf16:graphs,fp8:eager,fp8:graphs"
    argv = [*SMALL, "--device", device, "--steps", "12", "--log-every", "4", "--eval-every", "6",
            "--val-batches", "1", "--data", "synthetic"]  # fmt: skip
    assert train.main([*argv, "--compare", runs, "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["model"]["batch"], summary["model"]["seq_len"]) == (2, 32)
    assert summary["data"]["source"] == "synthetic" and summary["eval_every"] == 6
    runs = {r["name"]: r for r in summary["runs"]}
    for r in runs.values():  # torch.cuda.max_memory_reserved of each run; null on the CPU
        assert (r["peak_reserved_bytes"] is None) == (device == "cpu"), r["peak_reserved_bytes"]
    losses = {name: r["losses"] for name, r in runs.items()}
    vals = {name: r["val_losses"] for name, r in runs.items()}
    assert len(losses["fp8-graphs"]) == 12 and [s for s, _ in vals["fp8-graphs"]] == [6, 12]
    for precision in ("bf16", "fp8"):
        graphed, eager = f"{precision}-graphs", f"{precision}-eager"
        assert losses[graphed] == losses[eager], f"{precision}: graphed != eager"
        assert vals[graphed] == vals[eager], f"{precision}: validation graphed != eager"
    for name, curve in losses.items():
        assert curve[-1] < curve[0] - 1.0, f"{name}: loss did not go down: {curve}"
        assert vals[name][-1][1] < curve[0] - 1.0, f"{name}: validation loss: {vals[name]}"
    assert abs(losses["fp8-eager"][-1] / losses["bf16-eager"][-1] - 1) < 0.05
    assert runs["fp8-graphs"]["final_val_loss"] == vals["fp8-graphs"][-1][1]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = (tmp_path / "fp8-graphs.csv").read_text().splitlines()
    assert rows[0] == "step,loss,val_loss,lr,tokens,elapsed_s,tokens_per_s" and len(rows) == 13
    assert rows[6].split(",")[2] == str(vals["fp8-graphs"][0][1]) and rows[5].split(",")[2] == ""
    out = capsys.readouterr().out
    assert "val loss" in out and "fp8-graphs" in out


def _fp8_state(model: torch.nn.Module) -> list[torch.Tensor]:
    metas = [m.fp8_meta for m in model.modules() if getattr(m, "fp8_meta", None) is not None]
    return [t.clone() for meta in metas for b in (meta.fwd, meta.bwd)
            for t in (b.history(), b.scales())]  # fmt: skip


def test_validation_changes_no_state(device, synthetic):
    """After a training step: evaluating leaves weights, optimizer state and every FP8 amax
    history and scale bit for bit as they were, and gives the same loss twice."""
    spec = RunSpec("tiny", TINY, "fp8", graphs=False, microbatches=2, device=device)
    run = Run(spec, synthetic)
    run.prepare()
    run.train_step(4)
    fp8, params = _fp8_state(run.model), [p.clone() for p in run.model.parameters()]
    adam = [t.clone() for s in run.optimizer.state.values() for t in s.values()]
    batches = synthetic.val_batches(32, batch=2, max_batches=2)
    first = validation_loss(run, batches)
    assert validation_loss(run, batches) == first and 0 < first < 6
    for before, after in zip(fp8, _fp8_state(run.model), strict=True):
        assert_bitwise_equal(after, before)
    for before, after in zip(params, run.model.parameters(), strict=True):
        assert_bitwise_equal(after, before) and after.grad is None
    after_adam = [t for s in run.optimizer.state.values() for t in s.values()]
    for before, after in zip(adam, after_adam, strict=True):
        assert_bitwise_equal(after, before)
    assert run.step == 1 and run.model.training


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert_bitwise_equal(b[name], value, name)
        elif isinstance(value, dict):  # FP8 extra state
            for key, t in value.items():
                if isinstance(t, torch.Tensor):
                    assert_bitwise_equal(b[name][key], t, f"{name}.{key}")


@pytest.mark.parametrize("graphs", [False, True])
def test_resume_is_bit_exact(device, tmp_path, graphs, synthetic, capsys):
    """6 steps straight (validation at 4 and 6) == 3 steps (validation at 2 and 3), saved, then
    resumed (validation at 4 and 6): training and validation losses and every weight and FP8
    history bit for bit, so the extra validations changed nothing. The resumed progress line
    counts from the run's start."""
    spec = RunSpec("tiny", TINY, "fp8", graphs, microbatches=2, device=device)
    kw = dict(out=tmp_path, data=synthetic, keep_state=True, log_every=1, val_batches=1)
    ckpt = tmp_path / "ckpt.pt"
    straight = train_run(spec, RunOptions(steps=6, eval_every=4, **kw))
    half = train_run(spec, RunOptions(steps=6, eval_every=2, stop_at=3, save=ckpt, **kw))
    assert f"saved {ckpt} (step 3 of 6)" in capsys.readouterr().out
    resumed = train_run(spec, RunOptions(steps=6, eval_every=4, resume=ckpt, **kw))
    progress = capsys.readouterr().err
    assert "4/6" in progress and "6/6" in progress and "1/3" not in progress
    assert resumed["first_step"] == 3
    assert half["losses"] == straight["losses"][:3]
    assert resumed["losses"] == straight["losses"][3:]
    assert [s for s, _ in half["val_losses"]] == [2, 3]
    assert [s for s, _ in straight["val_losses"]] == [4, 6]
    assert resumed["val_losses"] == straight["val_losses"]
    _assert_same_state(straight["model_state"], resumed["model_state"])


@pytest.mark.parametrize(
    "ddp_device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 GPUs")])],
)  # fmt: skip
def test_ddp_under_torchrun(tmp_path, ddp_device):
    """torchrun --nproc_per_node=2 -m graphfp8.training --ddp on the default data (the standard
    library): both ranks end with the same FP8 scales and histories and the same parameters,
    agree on the validation loss (each evaluates its own windows: only the reduction makes them
    agree), and the loss goes down."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "graphfp8.training", "--ddp", "--device", ddp_device, *SMALL, "--steps", "8",
           "--log-every", "4", "--eval-every", "8", "--val-batches", "2", "--out",
           str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    run = summary["runs"][0]
    assert summary["world_size"] == 2 and summary["data"]["source"] == "stdlib"
    assert run["ranks_agree"] == {"fp8_state": True, "parameters": True, "val_loss": True}
    assert run["losses"][-1] < run["losses"][0] - 0.5
    assert [s for s, _ in run["val_losses"]] == [8]
    assert "fp8_state identical, parameters identical, val_loss identical" in done.stdout
