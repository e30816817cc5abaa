"""The profile runner (`make profile`) on the CPU and its trace statistics."""

from __future__ import annotations

import json

import pytest

from graphfp8.training import step_profile as profile_runner
from graphfp8.training.trace_stats import busy_fraction, parse_gpu_trace, top_kernels


def test_profile_runner_writes_summary(tmp_path):
    argv = ["--device", "cpu", "--steps", "1", "--warmup-steps", "1", "--microbatches", "2",
            "--batch", "2", "--seq-len", "32", "--out", str(tmp_path)]  # fmt: skip
    assert profile_runner.main(argv) == 0
    summary = json.loads((tmp_path / "profile_tiny_fp8-graphs.json").read_text())
    assert summary["profile"]["tool"] == "torch.profiler"
    assert summary["profile"]["top_level_ops_per_microbatch"] > 50
    assert summary["host_ms_per_microbatch"] > 0
    assert "| kernel | calls |" in (tmp_path / "profile_tiny_fp8-graphs.md").read_text()


def test_profile_runner_refuses_bad_data(tmp_path, capsys):
    argv = ["--device", "cpu", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path)]
    assert profile_runner.main(argv) == 2
    assert "no such file or folder" in capsys.readouterr().err


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


def test_busy_is_over_the_unprofiled_wall():
    """The summary's busy line divides the kernels' union by the unprofiled wall (issue 41: the
    profiled span is longer than the wall and flattered it), and lists every category."""
    from graphfp8.training.kernel_table import kernel_table

    table = kernel_table([("nvjet_x", 0.0, 900.0), ("rope_k", 800.0, 1000.0)], steps=1)
    summary = {"wall_ms_per_microbatch": 1.25, "profile": {"kernel_table": table}}
    lines = profile_runner._busy_lines(summary)
    assert lines[0].startswith("- GPU busy over the unprofiled wall: 0.800 ")
    assert any(line.startswith("| other | 0.000 |") for line in lines)
    assert profile_runner._busy_lines({"profile": {}}) == []
