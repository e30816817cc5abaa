"""scripts/bench_blockwise.py on the CPU (a smoke run of two of its rows, tiny shapes): every row
it times comes back as tokens/s per repeat, not as the error text a refused row prints."""

from __future__ import annotations

from tests.test_layout import _load


def test_rows_run_on_the_cpu(capsys):
    bench = _load("bench_blockwise")
    before = bench.PLAIN.on
    rows = bench.main(["--device", "cpu", "--hidden", "128", "--heads", "2", "--kv-heads", "1",
                       "--ffn", "128", "--seq", "16", "--iters", "1", "--microbatches", "2",
                       "--repeats", "2", "--rows",
                       "delayed,blockwise-fused-cache,blockwise-glu-kernel"])  # fmt: skip
    assert set(rows) == {"delayed", "blockwise-fused-cache", "blockwise-glu-kernel"}
    assert bench.PLAIN.on is before  # the rows' switch restored
    for name, value in rows.items():
        assert isinstance(value, list) and len(value) == 2 and min(value) > 0, (name, value)
    assert "x delayed" in capsys.readouterr().out
