"""`python -m benchmarks carried-casts --quick` runs on the CPU and writes its table (the times mean
nothing there); the op count it reports is exact: the carried schedule casts the 4 weights of each
block on all 4 microbatches of a step, the cached one on the first only."""

from __future__ import annotations

import json

import benchmarks.carried_casts as bench
from benchmarks.__main__ import main


def test_carried_casts_quick(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "QUICK", {"tiny (2 blocks)": bench.QUICK["tiny (2 blocks)"]})
    path = tmp_path / "carried.json"
    main(["carried-casts", "--quick", "--device", "cpu", "--json", str(path)])
    (row,) = json.loads(path.read_text())["shapes"].values()
    cached, recast = row["eager cached graphfp8 ops"], row["eager recast (carried) graphfp8 ops"]
    assert recast - cached == 2 * 4 * (1 - 1 / bench.MICRO), "2 blocks x 4 weight casts"
    assert row["eager ratio"] > 0 and row["graphed ratio"] > 0
    assert "| tiny (2 blocks) |" in capsys.readouterr().out
