"""`python -m benchmarks hf --quick` runs on the CPU (without torch.compile's peer) when
transformers is installed: the training peers, then Trainer's (HF bf16, graphfp8 FP8 eager and
with layer graphs) and generate()'s (issue 32)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.__main__ import main

pytest.importorskip("transformers")


def test_hf_quick(tmp_path, capsys):
    path = tmp_path / "hf.json"
    main(["hf", "--quick", "--device", "cpu", "--json", str(path)])
    peers = json.loads(path.read_text())["peers"]
    assert list(peers) == ["HF bf16 eager", "graphfp8 FP8 layer graphs", "graphfp8 FP8 step graph"]
    for name, row in peers.items():
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, name
        assert 3.0 < row["final_loss"] < 7.0, name  # ln 256 = 5.5 at the start
    out = json.loads(path.read_text())
    assert list(out["trainer"]) == ["Trainer + HF bf16", "Trainer + graphfp8 FP8 eager",
                                    "Trainer + graphfp8 FP8 layer graphs"]  # fmt: skip
    for name, row in out["trainer"].items():  # the same rows, weights and order
        assert row["tokens_per_s"] > 0 and abs(row["mean_loss"] - 5.55) < 0.05, name
    assert list(out["generate"]) == ["HF bf16 generate", "graphfp8 bf16 generate",
                                     "graphfp8 FP8 generate"]  # fmt: skip
    assert all(r["tokens_per_s"] > 0 for r in out["generate"].values())
    assert all("busy_fraction" not in r for r in out["generate"].values())  # not profiled
    text = capsys.readouterr().out
    assert "/ HF bf16 eager" in text and "/ Trainer + HF bf16" in text and "generate()" in text


def test_a_profiled_generate_call_counts_kernels_per_new_token():
    """gpu_check's step `generate`: one more call of profile_new tokens under torch.profiler;
    the CPU has no kernels, so no busy fraction is made up."""
    from benchmarks.hf_model import QUICK, hf_model
    from benchmarks.hf_users import _generate_run

    prompts = torch.randint(1, 256, (2, 8))
    row = _generate_run(hf_model(QUICK, "cpu").eval(), prompts, 4, 1, "cpu", profile_new=2)
    assert row["tokens_per_s"] > 0
    assert row["kernels_per_new_token"] == 0 and row["busy_fraction"] is None
