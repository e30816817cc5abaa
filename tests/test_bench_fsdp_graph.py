"""benchmarks/fsdp_graph.py on the CPU with small shapes (not speed: that it builds the microbatch
runs at world size 1 on one gloo rank, times them and finds the FSDP2 graph's losses equal to
eager FSDP2's, and times every step graph of its step table: FSDP2's defaults and
reshard_after_forward=False, each with fsdp_sync 'every' and 'last', and the unsharded one)."""

from __future__ import annotations

from benchmarks import fsdp_graph


def test_fsdp_graph_benchmark_runs_and_the_graph_equals_eager():
    result = fsdp_graph.run("cpu", quick=True)
    assert result["graph_equals_eager"] is True
    for name in ("fsdp2-eager", "fsdp2-graph", "unsharded-graph"):
        row = result[name]
        assert row["ms_per_microbatch"] > 0
        assert row["vs_fsdp2_eager"] > 0 and row["vs_unsharded_graph"] > 0
    assert result["fsdp2-eager"]["vs_fsdp2_eager"] == 1.0
    assert result["fsdp2-eager-accum"]["ms_per_microbatch"] > 0
    step = result["step"]
    assert set(fsdp_graph.STEPS) <= set(step)
    for name in fsdp_graph.STEPS:
        assert len(step[name]["ms_per_step"]) == fsdp_graph.STEP_REPEATS
        assert step[name]["tokens_per_s"] > 0 and step[name]["vs_unsharded"] > 0
    assert step["unsharded-step"]["vs_unsharded"] == 1.0
    assert step["fsdp2_vs_unsharded"] == step["fsdp2-step"]["vs_unsharded"]


def test_kernel_diff_orders_by_the_difference_and_totals_first():
    kernels = {
        "fsdp2-step": {"gemm": (4, 100.0), "copy": (8, 40.0), "nccl": (2, 10.0)},
        "unsharded-step": {"gemm": (4, 101.0), "adam": (1, 5.0)},
    }
    rows = fsdp_graph._kernel_diff(kernels)
    other = {**kernels, "other": kernels["fsdp2-step"]}
    assert fsdp_graph._kernel_diff(other, name="other") == rows
    assert rows[0] == ["(all kernels)", "14", "150", "5", "106", "+44"]
    assert [r[0] for r in rows[1:]] == ["copy", "nccl", "adam", "gemm"]
    assert rows[1][1:] == ["8", "40", "0", "0", "+40"] and rows[3][-1] == "-5"
