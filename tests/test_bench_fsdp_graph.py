"""benchmarks/fsdp_graph.py on the CPU with small shapes (not speed: that it builds the three runs
at world size 1 on one gloo rank, times them and finds the FSDP2 graph's losses equal to eager
FSDP2's)."""

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


def test_kernel_diff_orders_by_the_difference_and_totals_first():
    kernels = {
        "fsdp2-step": {"gemm": (4, 100.0), "copy": (8, 40.0), "nccl": (2, 10.0)},
        "unsharded-step": {"gemm": (4, 101.0), "adam": (1, 5.0)},
    }
    rows = fsdp_graph._kernel_diff(kernels)
    assert rows[0] == ["(all kernels)", "14", "150", "5", "106", "+44"]
    assert [r[0] for r in rows[1:]] == ["copy", "nccl", "adam", "gemm"]
    assert rows[1][1:] == ["8", "40", "0", "0", "+40"] and rows[3][-1] == "-5"
