"""`python -m graphfp8.bench hf --quick` runs on the CPU (without torch.compile's peer) when
transformers is installed."""

from __future__ import annotations

import json
import math

import pytest

from graphfp8.bench.__main__ import main

pytest.importorskip("transformers")


def test_hf_quick(tmp_path, capsys):
    path = tmp_path / "hf.json"
    main(["hf", "--quick", "--device", "cpu", "--json", str(path)])
    peers = json.loads(path.read_text())["peers"]
    assert list(peers) == ["HF bf16 eager", "graphfp8 FP8 layer graphs", "graphfp8 FP8 step graph"]
    for name, row in peers.items():
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, name
        assert 3.0 < row["final_loss"] < 7.0, name  # ln 256 = 5.5 at the start
    assert "/ HF bf16 eager" in capsys.readouterr().out
