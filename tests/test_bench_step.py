"""`python -m benchmarks step --quick` on the CPU tape: every peer runs and is reported
(speed is measured on the GPU; nothing here asserts on time)."""

from __future__ import annotations

import json

from benchmarks.__main__ import main


def test_step_bench_quick_on_cpu(tmp_path, capsys):
    path = tmp_path / "step.json"
    main(["step", "--quick", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    assert set(result["block"]) == {"fp8 step graph", "fp8 layer graphs", "bf16 step graph"}
    assert [r["layers"] for r in result["layers"]] == [1, 2]
    for row in [*result["block"].values(), *(r["fp8 step graph"] for r in result["layers"])]:
        assert row["host_ms"] > 0 and row["device_ms"] > 0 and row["kernels"] is None
    for name, row in result["block"].items():  # the launch without the checks: step graphs
        assert (row["launch_host_ms"] is not None) == name.endswith("step graph"), name
        assert row["launch_host_ms"] is None or row["launch_host_ms"] > 0
    out = capsys.readouterr().out
    assert "fp8 step graph relative to fp8 layer graphs" in out
    assert "host ms per optimizer step vs layers" in out and "of which launch" in out
