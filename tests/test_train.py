"""graphfp8-train and the profile runner on the CPU: losses go down, graphed == eager, bit-exact
resume, logs and plot written, clear argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphfp8 import train
from graphfp8.testing import assert_bitwise_equal
from graphfp8.training import profile as profile_runner
from graphfp8.training.data import batch, make_corpus
from graphfp8.training.loop import RunOptions, train_run
from graphfp8.training.model import PRESETS
from graphfp8.training.profile_stats import busy_fraction, parse_gpu_trace, top_kernels
from graphfp8.training.run import RunSpec

SMALL = ["--batch", "2", "--seq-len", "32", "--microbatches", "2"]


def test_corpus_and_batches_are_deterministic():
    a, b = make_corpus(4096, seed=3), make_corpus(4096, seed=3)
    assert_bitwise_equal(a, b)
    assert not torch.equal(a, make_corpus(4096, seed=4))
    assert_bitwise_equal(batch(a, 5, 1, 4, 16), batch(a, 5, 1, 4, 16))
    assert not torch.equal(batch(a, 5, 1, 4, 16), batch(a, 5, 1, 4, 16, rank=1))
    assert batch(a, 0, 0, 4, 16).shape == (4, 17)


def test_compare_trains_graphed_equal_to_eager_and_writes_logs(device, tmp_path, capsys):
    runs = "bf16:eager,bf16:graphs,fp8:eager,fp8:graphs"
    argv = [*SMALL, "--device", device, "--steps", "12", "--log-every", "4"]
    assert train.main([*argv, "--compare", runs, "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["model"]["batch"], summary["model"]["seq_len"]) == (2, 32)
    losses = {r["name"]: r["losses"] for r in summary["runs"]}
    assert len(losses["fp8-graphs"]) == 12
    for r in summary["runs"]:  # torch.cuda.max_memory_reserved of each run; null on the CPU
        assert (r["peak_reserved_bytes"] is None) == (device == "cpu"), r["peak_reserved_bytes"]
    assert losses["bf16-graphs"] == losses["bf16-eager"], "bf16 graphed != eager"
    assert losses["fp8-graphs"] == losses["fp8-eager"], "fp8 graphed != eager"
    for name, curve in losses.items():
        assert curve[-1] < curve[0] - 1.0, f"{name}: loss did not go down: {curve}"
    assert abs(losses["fp8-eager"][-1] / losses["bf16-eager"][-1] - 1) < 0.05
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = (tmp_path / "fp8-graphs.csv").read_text().splitlines()
    assert rows[0] == "step,loss,lr,tokens,elapsed_s,tokens_per_s" and len(rows) == 13
    assert "fp8-graphs" in capsys.readouterr().out


@pytest.mark.parametrize("graphs", [False, True])
def test_resume_is_bit_exact(device, tmp_path, graphs):
    """A 6-step run stopped after step 3 and saved, then resumed == 6 steps straight: losses
    and every weight and FP8 history bit for bit."""
    model = type(PRESETS["tiny"])(**{**PRESETS["tiny"].to_dict(), "batch": 2, "seq_len": 32})
    spec = RunSpec("tiny", model, "fp8", graphs, microbatches=2, device=device)
    corpus = make_corpus(1 << 16)
    kw = dict(out=tmp_path, corpus=corpus, keep_state=True, log_every=2)
    straight = train_run(spec, RunOptions(steps=6, **kw))
    train_run(spec, RunOptions(steps=6, stop_at=3, save=tmp_path / "ckpt.pt", **kw))
    resumed = train_run(spec, RunOptions(steps=6, resume=tmp_path / "ckpt.pt", **kw))
    assert resumed["first_step"] == 3
    assert resumed["losses"] == straight["losses"][3:]
    assert straight["model_state"].keys() == resumed["model_state"].keys()
    for name, value in straight["model_state"].items():
        if isinstance(value, torch.Tensor):
            assert_bitwise_equal(resumed["model_state"][name], value, name)
        elif isinstance(value, dict):  # FP8 extra state
            for key, t in value.items():
                if isinstance(t, torch.Tensor):
                    assert_bitwise_equal(resumed["model_state"][name][key], t, f"{name}.{key}")


def test_resume_rejects_another_run(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    argv = [*SMALL, "--device", "cpu", "--steps", "2", "--out", str(tmp_path)]
    assert train.main([*argv, "--save", str(ckpt)]) == 0
    with pytest.raises(ValueError, match="precision: checkpoint 'fp8', this run 'bf16'"):
        train.main([*argv, "--resume", str(ckpt), "--precision", "bf16"])


def test_resume_with_nothing_left_to_train(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    argv = [*SMALL, "--device", "cpu", "--steps", "2", "--out", str(tmp_path)]
    assert train.main([*argv, "--save", str(ckpt)]) == 0
    with pytest.raises(ValueError, match="checkpoint is at step 2"):
        train.main([*argv, "--resume", str(ckpt)])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare", "fp16"], "bad run 'fp16'"),
        (["--compare", "fp8:graph"], "bad run 'fp8:graph'"),
        (["--compare", "fp8,fp8"], "listed twice"),
        (["--seq-len", "20"], "multiple of 16"),
        (["--steps", "0"], "must be >= 1"),
        (["--resume", "/nonexistent/ckpt.pt"], "no checkpoint"),
        (["--compare", "--save", "x.pt"], "single run"),
        (["--precision", "fp4"], "invalid choice"),
    ],
)
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cpu", *args])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_device_without_gpu(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cuda"])
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    "ddp_device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs 2 GPUs")])],
)  # fmt: skip
def test_ddp_under_torchrun(tmp_path, ddp_device):
    """torchrun --nproc_per_node=2 -m graphfp8.train --ddp: both ranks end with the same FP8
    scales and histories and the same parameters, and the loss goes down."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "graphfp8.train", "--ddp", "--device", ddp_device, *SMALL, "--steps", "8",
           "--log-every", "4", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    run = summary["runs"][0]
    assert summary["world_size"] == 2
    assert run["ranks_agree"] == {"fp8_state": True, "parameters": True}
    assert run["losses"][-1] < run["losses"][0] - 0.5
    assert "fp8_state identical, parameters identical" in done.stdout


def test_ddp_without_torchrun(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--device", "cpu", "--ddp"])
    assert "runs under torchrun" in capsys.readouterr().err


def test_profile_runner_writes_summary(tmp_path):
    argv = ["--device", "cpu", "--steps", "1", "--warmup-steps", "1", "--microbatches", "2",
            "--out", str(tmp_path)]  # fmt: skip
    assert profile_runner.main(argv) == 0
    summary = json.loads((tmp_path / "profile_tiny_fp8-graphs.json").read_text())
    assert summary["profile"]["tool"] == "torch.profiler"
    assert summary["profile"]["top_level_ops_per_microbatch"] > 50
    assert summary["host_ms_per_microbatch"] > 0
    assert "| kernel | calls |" in (tmp_path / "profile_tiny_fp8-graphs.md").read_text()


def test_busy_fraction_and_top_kernels():
    assert busy_fraction([(0, 10), (5, 15), (20, 30)]) == pytest.approx(25 / 30)
    assert busy_fraction([(0, 10), (2, 3)]) == 1.0
    top = top_kernels([("a", 1.0), ("b", 5.0), ("a", 1.0)])
    assert [(k["name"], k["calls"], k["us"]) for k in top] == [("b", 1, 5.0), ("a", 2, 2.0)]


def test_parse_nsys_gpu_trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(
        '"Start (ns)","Duration (ns)","CorrId","Name"\n'
        '100,50,1,"gemm_kernel"\n'
        '160,10,2,"[CUDA memcpy Device-to-Device]"\n'
        '170,30,3,"cast_transpose_vec_kernel"\n'
    )
    assert parse_gpu_trace(path) == [("gemm_kernel", 100.0, 150.0),
                                     ("cast_transpose_vec_kernel", 170.0, 200.0)]  # fmt: skip
