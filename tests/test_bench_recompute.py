"""`python -m benchmarks recompute --quick` and `memory-plan --quick` run on the CPU and write
complete tables (the numbers that matter come from the H200: scripts/gpu_check.sh)."""

from __future__ import annotations

import json

from benchmarks.__main__ import main
from benchmarks.memory_plan import _tokens


def test_recompute_quick(tmp_path, capsys):
    path = tmp_path / "recompute.json"
    main(["recompute", "--quick", "--device", "cpu", "--json", str(path)])
    results = json.loads(path.read_text())["results"]
    assert list(results) == ["none", "selective", "full"]
    kept = [results[m]["kept_bytes"] for m in results]
    assert kept[2] < kept[1] < kept[0]
    assert results["none"]["memory_ratio"] == 1.0 and results["full"]["memory_ratio"] < 0.25
    assert "| full |" in capsys.readouterr().out


def test_memory_plan_quick(tmp_path):
    path = tmp_path / "plan.json"
    main(["memory-plan", "--quick", "--device", "cpu", "--json", str(path)])
    results = json.loads(path.read_text())["results"]
    assert [(r["recompute"], r["graphs"], r["sharding"]) for r in results] == [
        ("none", "layers", "ddp"), ("full", "layers", "ddp"), ("selective", "step", "ddp"),
        ("full", "none", "ddp"), ("full", "none", "fsdp2"), ("full", "none", "fsdp2"),
    ]  # fmt: skip
    # the CPU's peak (benchmarks.memory_plan.cpu_peak) beside each plan
    assert all(r["plan"]["peak"] > 0 and r["measured_peak"] > 0 for r in results)


def test_memory_plan_token_file_holds_llama_vocabularies(tmp_path):
    """The full run's synthetic token file for Llama 3's 128256 tokens opens and holds ids above
    65535 (failed before: "uint16 token files hold tokens below 65536")."""
    data = _tokens(tmp_path, 128256, 4096)
    tokens = data.stream.read(0, 4096)
    assert data.vocab_size == 128256 and 65535 < int(tokens.max()) < 128256
