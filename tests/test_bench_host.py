"""`python -m benchmarks host --quick` on the CPU: every entry point's row at 1 and 2 layers,
with the tape's replay timed apart from the checks, and the summary tables (the numbers
themselves mean nothing on a CPU)."""

from __future__ import annotations

import json
import math

from benchmarks.__main__ import main

CPU_PEERS = ["g8 callable", "g8 per-layer", "g8 per-layer chain", "g8 microbatch graph",
             "g8 step graph"]  # fmt: skip


def test_host_bench_quick_on_cpu(tmp_path, capsys):
    path = tmp_path / "host.json"
    main(["host", "--quick", "--device", "cpu", "--json", str(path)])
    result = json.loads(path.read_text())
    rows = {(r["peer"], r["layers"]): r for r in result["rows"]}
    assert set(rows) == {(p, n) for p in CPU_PEERS for n in (1, 2)} | {("autograd floor", 1)}
    for key, row in rows.items():
        for name in ("host_us", "checks_us"):
            assert math.isfinite(row[name]) and row[name] > 0, (key, name)
    assert all(rows[("g8 step graph", n)]["launch_us"] > 0 for n in (1, 2))
    printed = capsys.readouterr().out
    assert all(line in printed for line in result["table"].splitlines())
    assert "| g8 per-layer chain | 2 |" in printed and "Python µs" in printed
