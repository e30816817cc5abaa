"""benchmarks/blockwise_te.py (bench_blockwise's MLP rows against TransformerEngine's
Float8BlockScaling) on the CPU with tiny shapes: the graphfp8 peers time and print; TE's rows are
absent without TE and a CUDA device (the numbers come from the H200: scripts/gpu_check.sh)."""

from __future__ import annotations

import math

from benchmarks.blockwise_te import mlp_rows, print_mlp


def test_mlp_rows_on_the_cpu(capsys):
    rows = mlp_rows(32, 48, 32, "cpu", iters=2, repeats=1)
    assert list(rows) == ["graphfp8 delayed graphed", "graphfp8 blockwise graphed",
                          "graphfp8 blockwise+glu graphed"]  # fmt: skip
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in rows.values())
    print_mlp({**rows, "TE blockwise graphed": "RuntimeError: refused"}, 32, 48, 32)
    out = capsys.readouterr().out
    assert "graphfp8 blockwise is 1.000x this" in out and "RuntimeError: refused" in out
