"""graphfp8-train --fp8-stats: every FP8 cast's statistics on the steps it names, the same rows
eager, with per-layer graphs and with the step graph's microbatch 0 weights, losses unchanged."""

from __future__ import annotations

import csv
import json

from graphfp8.training import cli as train

ARGV = ["--preset", "tiny", "--batch", "2", "--seq-len", "32", "--microbatches", "2",
        "--steps", "4", "--val-batches", "1", "--data", "synthetic",
        "--eval-every", "2"]  # fmt: skip


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_fp8_stats_csv_graphed_equal_eager_and_training_unchanged(device, tmp_path):
    runs = "fp8:eager,fp8:graphs,fp8:step"
    assert train.main([*ARGV, "--device", device, "--compare", runs, "--fp8-stats", "2",
                       "--out", str(tmp_path / "on")]) == 0  # fmt: skip
    assert train.main([*ARGV, "--device", device, "--compare", "fp8:eager",
                       "--out", str(tmp_path / "off")]) == 0  # fmt: skip
    on = {r["name"]: r for r in json.loads((tmp_path / "on/summary.json").read_text())["runs"]}
    off = json.loads((tmp_path / "off/summary.json").read_text())["runs"][0]
    for r in on.values():
        assert r["losses"] == off["losses"], f"{r['name']}: the statistics changed training"
        assert r["val_losses"] == off["val_losses"]
        roles = r["fp8_stats"]["roles"]
        assert r["fp8_stats"]["every"] == 2 and "input" in roles
        assert all(d["amax_mismatches"] == 0 and d["casts"] > 0 for d in roles.values()), roles
    eager = _rows(tmp_path / "on/fp8-eager_fp8_stats.csv")
    assert eager == _rows(tmp_path / "on/fp8-graphs_fp8_stats.csv"), "graphed == eager"
    assert {r["step"] for r in eager} == {"0", "2"}
    # tiny: 2 layers x (4 inputs + 4 weights + 4 gradients) on microbatch 0, 8 after
    assert len(eager) == 2 * 2 * (12 + 8)
    for r in eager:
        assert r["recorded_amax"] == r["true_amax"], r
    step = _rows(tmp_path / "on/fp8-step_fp8_stats.csv")
    last = [r for r in eager if r["microbatch"] == "1" or r["role"] == "weight"]
    key = lambda r: (r["step"], r["layer"], r["gemm"], r["role"])  # noqa: E731
    assert sorted(step, key=key) == sorted([{**r, "microbatch": "1"} for r in last], key=key), (
        "the step graph: the last microbatch's casts and microbatch 0's weights"
    )
    assert (tmp_path / "on/fp8-graphs_fp8_stats.png").exists()
