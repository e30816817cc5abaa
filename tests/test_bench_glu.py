"""`python -m benchmarks glu --quick` runs on the CPU with every peer a CPU has and writes
complete tables (the numbers mean nothing there)."""

from __future__ import annotations

import json
import math

from benchmarks.__main__ import main


def test_glu_quick(tmp_path, capsys):
    path = tmp_path / "glu.json"
    main(["glu", "--quick", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    (shape,) = result["shapes"]
    assert list(shape["ms"]) == [
        "bf16 eager", "graphfp8 fp8 graphed (fused GLU)", "graphfp8 fp8 graphed (fallback)",
    ]  # fmt: skip
    assert all(math.isfinite(v) and v > 0 for v in shape["ms"].values())
    assert [k["op"] for k in result["kernels"]] == ["glu_cast_transpose", "dglu_cast_transpose"]
    printed = capsys.readouterr().out
    assert "speed-up over each peer" in printed and "| 32, 48, 32 |" in printed
