"""`python -m benchmarks grad-fill --quick` on the CPU: both runs captured in one process, timed,
and trained to the same loss bit for bit (the one-pass fill writes the same -0.0)."""

from __future__ import annotations

import json
import math

from benchmarks.__main__ import main


def test_grad_fill_quick(tmp_path, capsys):
    path = tmp_path / "grad_fill.json"
    main(["grad-fill", "--quick", "--device", "cpu", "--json", str(path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert row["preset"] == "llama-tiny"
    assert row["off_tokens_per_s"]["n"] == row["on_tokens_per_s"]["n"] == 2
    assert math.isfinite(row["on_vs_off"]) and row["on_vs_off"] > 0
    assert row["final_loss_on"] == row["final_loss_off"]
    assert "| llama-tiny |" in capsys.readouterr().out
