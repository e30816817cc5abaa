"""graphfp8-train --pack (packed documents) and the Llama presets: the segments and targets the
data gives, eager == per-layer graphs == step graph bit for bit on packed batches, and the
llama-tiny preset's blocks."""

from __future__ import annotations

import json

import pytest
import torch

from graphfp8.training import cli as train
from graphfp8.training.data import IGNORE, Dataset, split_windows
from graphfp8.training.model import GPT, PRESETS
from graphfp8.training.sources import DataError, open_stream


@pytest.fixture
def folder(tmp_path):
    """A folder of 40 text files (documents) of 30-400 bytes."""
    root = tmp_path / "docs"
    root.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(40):
        n = int(torch.randint(30, 400, (1,), generator=g))
        text = "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=g))
        (root / f"doc{i}.txt").write_text(f"# {i}\n{text}\n")
    return root


def test_segments_follow_the_files(folder):
    data = Dataset(open_stream(str(folder)), val_fraction=0.1, pack=True)
    tokens = data.train_batch(3, 1, batch=4, seq_len=64)
    segments = data.train_segments(3, 1, batch=4, seq_len=64)
    assert segments.shape == tokens.shape and (segments[:, 0] == 0).all()
    starts = data._train_starts(3, 1, 4, 64, 0, 0, 1)
    files = data.stream.files
    offsets = torch.tensor([0, *torch.tensor([f.tokens for f in files]).cumsum(0).tolist()])
    for row, start in enumerate(starts):
        doc = torch.searchsorted(offsets, torch.arange(start, start + 65), right=True) - 1
        assert (segments[row] == doc - doc[0]).all()
    assert bool((segments[:, 1:] != segments[:, :-1]).any()), "the windows cross files"
    inputs, targets, seg = split_windows(tokens, segments)
    crossing = segments[:, 1:] != segments[:, :-1]
    assert (targets[crossing] == IGNORE).all() and (
        targets[~crossing] == tokens[:, 1:][~crossing]
    ).all()
    assert torch.equal(seg, segments[:, :-1]) and torch.equal(inputs, tokens[:, :-1])
    (val_tokens, _, val_segments) = data.val_batches(64, batch=2, max_batches=1)[0]
    assert val_segments.shape == val_tokens.shape


def test_pack_needs_documents(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 5000)
    with pytest.raises(DataError, match="--pack: --data text is one document"):
        Dataset(open_stream(str(tmp_path / "one.txt")), pack=True)


def test_llama_tiny_blocks():
    model = GPT(PRESETS["llama-tiny"], torch.float32)
    layer = model.blocks.layers[0]
    assert (layer.num_heads, layer.num_gqa_groups, layer.mlp.activation) == (4, 2, "swiglu")
    assert layer.qkv.normalization == "RMSNorm" and isinstance(model.norm, torch.nn.RMSNorm)
    assert all(b is None for b in (layer.qkv.bias, layer.proj.bias, layer.mlp.fc1_bias))
    assert PRESETS["llama-100m"].to_dict()["kv_heads"] == 4
    assert "kv_heads" not in PRESETS["100m"].to_dict(), "older checkpoints record no such key"


def test_packed_llama_runs_graphed_equal_to_eager(folder, tmp_path):
    """FP8 on packed documents: eager, per-layer graphs and the step graph, bit for bit."""
    argv = ["--preset", "llama-tiny", "--batch", "2", "--seq-len", "32", "--microbatches", "2",
            "--data", str(folder), "--pack", "--steps", "3", "--log-every", "3",
            "--val-batches", "1", "--val-fraction", "0.2", "--device", "cpu",
            "--out", str(tmp_path)]  # fmt: skip
    assert train.main([*argv, "--compare", "fp8:eager,fp8:layers,fp8:step"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    runs = {r["name"]: r for r in summary["runs"]}
    assert set(runs) == {"fp8-eager-pack", "fp8-graphs-pack", "fp8-step-pack"}
    assert summary["data"]["pack"] is True and summary["model"]["activation"] == "swiglu"
    losses = [r["losses"] for r in runs.values()]
    vals = [r["val_losses"] for r in runs.values()]
    assert losses[0] == losses[1] == losses[2] and vals[0] == vals[1] == vals[2]
    assert losses[0][-1] < losses[0][0]
