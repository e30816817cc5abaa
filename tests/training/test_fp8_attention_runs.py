"""graphfp8-train --fp8-attention (RoPE fused into the FP8 casts, FP8 attention, its FP8 output
into the projection; the CPU runs the emulation with cuDNN's quantization points) and
--deterministic on the CPU: eager == per-layer graphs == step graph bit for bit, GQA (llama-tiny),
packed batches on bf16 attention, and the command line's checks."""

from __future__ import annotations

import json

import pytest
import torch

from graphfp8.training import cli as train
from tests.training.common import cli_refusal
from tests.training.test_pack import folder  # noqa: F401 - the packed-documents fixture

SMALL = ["--batch", "2", "--seq-len", "32", "--microbatches", "2", "--data", "synthetic",
         "--val-batches", "1", "--steps", "3", "--log-every", "3"]  # fmt: skip
# FP8 attention's shape per device: on the GPU cuDNN trains head_dim 128 (Hopper's only one).
MODEL = {"cpu": ["--preset", "tiny"],
         "cuda": ["--preset", "small", "--heads", "2", "--seq-len", "128"]}  # fmt: skip


def _runs(tmp_path, *args, device="cpu") -> dict:
    assert train.main([*SMALL, "--device", device, "--out", str(tmp_path), *args]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    return {r["name"]: r for r in summary["runs"]}


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_fp8_attention_trains_graphed_equal_to_eager(preset, tmp_path):
    """Every graph mode gives the eager losses bit for bit (llama-tiny: GQA, 4 heads on 2 kv
    heads), the loss falls, and FP8 attention is on: the losses are not FP8 without it."""
    runs = _runs(tmp_path, "--preset", preset, "--fp8-attention",
                 "--compare", "fp8:eager,fp8:layers,fp8:step")  # fmt: skip
    assert set(runs) == {"fp8-attn-eager", "fp8-attn-graphs", "fp8-attn-step"}
    losses = [r["losses"] for r in runs.values()]
    vals = [r["val_losses"] for r in runs.values()]
    assert losses[0] == losses[1] == losses[2] and vals[0] == vals[1] == vals[2]
    assert losses[0][-1] < losses[0][0]
    plain = _runs(tmp_path / "plain", "--preset", preset, "--compare", "fp8:eager")
    assert plain["fp8-eager"]["losses"] != losses[0]


def test_packed_batches_keep_bf16_attention(folder, tmp_path):  # noqa: F811
    """--pack --fp8-attention trains exactly as --pack without it (packed batches take bf16
    attention: graphfp8.modules.attention), graphed as eager."""
    argv = ["--preset", "llama-tiny", "--data", str(folder), "--pack", "--val-fraction", "0.2"]
    runs = _runs(tmp_path, *argv, "--fp8-attention", "--compare", "fp8:eager,fp8:step")
    plain = _runs(tmp_path / "plain", *argv, "--compare", "fp8:eager")
    losses = {name: r["losses"] for name, r in runs.items()}
    assert losses["fp8-attn-eager-pack"] == losses["fp8-attn-step-pack"]
    assert losses["fp8-attn-eager-pack"] == plain["fp8-eager-pack"]["losses"]


@pytest.mark.parametrize("attention", ["--fp8-attention", "--no-fp8-attention"])
def test_deterministic_runs_repeat_and_restore_torch(device, attention, tmp_path):
    """--deterministic: two runs give the same losses and validation losses, graphed and eager,
    with FP8 and bf16 attention (on the GPU FP8 attention is refused: graphfp8.ops.
    cudnn_determinism); the summary says so, and torch's settings are as before afterwards
    (the CLI runs in-process here)."""
    before = torch.are_deterministic_algorithms_enabled()
    argv = [*MODEL[device], attention, "--deterministic", "--compare", "fp8:step,fp8:eager"]
    if device == "cuda" and attention == "--fp8-attention":
        with pytest.raises(SystemExit):
            train.main([*SMALL, "--device", device, "--out", str(tmp_path), *argv])
        assert not (tmp_path / "summary.json").exists()
        assert torch.are_deterministic_algorithms_enabled() is before
        return
    a = _runs(tmp_path / "a", *argv, device=device)
    b = _runs(tmp_path / "b", *argv, device=device)
    for name, run in a.items():
        assert run["losses"] == b[name]["losses"] and run["val_losses"] == b[name]["val_losses"]
        assert run["deterministic"] is True
        assert run["fp8_attention"] is (attention == "--fp8-attention")
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["deterministic"] is True
    assert torch.are_deterministic_algorithms_enabled() is before


def test_deterministic_fp8_attention_on_the_gpu_is_refused(capsys):
    """--deterministic --fp8-attention on a GPU stops before anything runs, naming why (cuDNN's
    FP8 attention differed run to run on the H200); checked on the CPU with the GPU device named
    (the refusal comes before any cuDNN call). It used to train, giving different bits."""
    import argparse

    from graphfp8.training import cli_checks

    parser = argparse.ArgumentParser(prog="graphfp8-train")
    args = train.parse_args(["--device", "cpu", "--preset", "tiny", "--fp8-attention",
                             "--deterministic"])  # fmt: skip
    args.device = "cuda"
    with pytest.raises(SystemExit):
        cli_checks.check_model(parser, args)
    err = capsys.readouterr().err
    assert "--deterministic --fp8-attention" in err and "run to run on the H200" in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--precision", "bf16", "--fp8-attention"], "--fp8-attention: no run trains in FP8"),
        (["--fp8-attention", "--scaling", "current"], "FP8 attention is DelayedScaling only"),
        (["--heads", "3"], "--heads 3: the tiny preset needs heads dividing its width 64"),
        (["--preset", "llama-tiny", "--heads", "1"], "a multiple of its 2 key/value heads"),
        (["--heads", "8", "--fp8-attention"], "head_dim a multiple of 16"),
    ],
)
def test_bad_fp8_attention_arguments(args, message, capsys):
    err = cli_refusal(args, capsys)
    assert message in err, err
