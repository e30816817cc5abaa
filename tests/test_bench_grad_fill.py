"""`python -m benchmarks grad-fill --quick` on the CPU: the three variants captured in one
process, timed, and trained to the same loss bit for bit (the fill writes the same -0.0, the
copy-first fold the same bits as the fill and the add)."""

from __future__ import annotations

import json
import math

from benchmarks.__main__ import main


def test_grad_fill_quick(tmp_path, capsys):
    path = tmp_path / "grad_fill.json"
    main(["grad-fill", "--quick", "--device", "cpu", "--json", str(path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert row["preset"] == "llama-tiny"
    variants = row["variants"]
    assert list(variants) == ["default", "fill-one-pass", "copy-first"]
    assert all(v["tokens_per_s"]["n"] == 3 for v in variants.values())
    assert all(math.isfinite(v["vs_default"]) and v["vs_default"] > 0 for v in variants.values())
    assert len({v["final_loss"] for v in variants.values()}) == 1
    assert "| llama-tiny | copy-first |" in capsys.readouterr().out
