"""`python -m benchmarks grad-fill --quick` on the CPU: the four variants captured in one
process, timed, and trained to the same loss bit for bit (the fill writes the same -0.0, the
copy-first fold the same bits as the fill and the add) but wgrad-into-grad's (its GEMM rounds
dW + .grad once)."""

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
    assert list(variants) == ["default", "fill-one-pass", "copy-first", "wgrad-into-grad"]
    assert all(v["tokens_per_s"]["n"] == 3 for v in variants.values())
    assert all(math.isfinite(v["vs_default"]) and v["vs_default"] > 0 for v in variants.values())
    same = {name: v["final_loss"] for name, v in variants.items() if name != "wgrad-into-grad"}
    assert len(set(same.values())) == 1, same
    assert math.isfinite(variants["wgrad-into-grad"]["final_loss"])
    out = capsys.readouterr().out
    assert "| llama-tiny | copy-first |" in out and "| llama-tiny | wgrad-into-grad |" in out
