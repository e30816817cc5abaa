"""`python -m benchmarks wgrad-accum --quick` runs on the CPU and writes complete tables (the
numbers mean nothing there)."""

from __future__ import annotations

import json
import math

from benchmarks.__main__ import main


def test_wgrad_accum_quick(tmp_path, capsys):
    path = tmp_path / "wgrad.json"
    main(["wgrad-accum", "--quick", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    (gemm,) = result["gemms"]
    for peer in ("bf16 wgrad + add", "fp32 wgrad + add", "fused (beta = 1)"):
        assert len(gemm[peer]["repeats"]) == 3 and math.isfinite(gemm[peer]["ms"])
    (mlp,) = result["mlps"]
    assert all(mlp[p]["ms"] > 0 for p in ("graphed + add", "graphed fused"))
    printed = capsys.readouterr().out
    assert "fused / bf16+add" in printed and "| 32, 48, 32 |" in printed
