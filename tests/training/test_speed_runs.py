"""Issue 41's training parts on the CPU: the Llama presets' shapes, the compiled plain-torch bf16
baseline (one tiny compiled run), every run's speed fields and baseline, and batches staged ahead
giving the same bits."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from graphfp8.memory.shapes import LLAMA, shape_from
from graphfp8.testing import assert_bitwise_equal
from graphfp8.training import cli as train
from graphfp8.training.cli_checks import model_config
from graphfp8.training.data import Dataset, split_windows
from graphfp8.training.model import GPT, PRESETS, count_parameters
from graphfp8.training.run import Run, RunSpec
from graphfp8.training.sources import open_stream
from graphfp8.training.staging import BatchStager
from graphfp8.training.torch_model import TorchGPT

TINY = dataclasses.replace(PRESETS["llama-tiny"], batch=2, seq_len=32)


@pytest.fixture(scope="module")
def synthetic() -> Dataset:
    return Dataset(open_stream("synthetic", synthetic_bytes=1 << 16), val_fraction=0.05)


# Hugging Face's parameter counts of meta-llama/Llama-3.2-1B (tied embeddings) and
# meta-llama/Meta-Llama-3-8B.
@pytest.mark.parametrize("preset, published", [("llama-1b", 1_235_814_400),
                                               ("llama-8b", 8_030_261_248)])  # fmt: skip
def test_llama_presets_have_the_published_parameter_counts(preset, published):
    cfg = PRESETS[preset]
    gpt, torch_gpt = GPT(cfg, device="meta"), TorchGPT(cfg, device="meta")
    assert count_parameters(gpt) == count_parameters(torch_gpt) == published
    assert (gpt.head.weight is gpt.embed.weight) == cfg.tie_embeddings
    assert (torch_gpt.head.weight is torch_gpt.embed.weight) == cfg.tie_embeddings
    assert shape_from(cfg) == LLAMA[preset]  # the memory planner's table, tied head included
    assert shape_from(cfg).parameters() == published


def test_layers_override_and_llama_vocabulary():
    """--layers replaces the preset's depth; a preset with its own vocabulary keeps it over the
    bytes' 256, the byte presets take the data's."""
    args = train.parse_args(["--preset", "llama-8b", "--layers", "2", "--device", "cpu"])
    cfg = model_config(args, 256)
    assert (cfg.layers, cfg.vocab, cfg.hidden, cfg.ffn, cfg.kv_heads) == (2, 128256, 4096,
                                                                          14336, 8)  # fmt: skip
    assert model_config(train.parse_args(["--preset", "tiny", "--device", "cpu"]), 100).vocab == 100


@pytest.mark.parametrize("argv, message", [
    (["--compare", "fp8:compile"], "plain-torch bf16 baseline"),
    (["--compare", "bf16:compile,fp8:graphs", "--pack"], "leave out --pack"),
    (["--precision", "fp8", "--graphs", "compile"], "plain-torch bf16 baseline"),
])  # fmt: skip
def test_compiled_baseline_misuse_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.parse_args([*argv, "--device", "cpu"])
    assert message in capsys.readouterr().err


def test_compiled_run_trains_the_torch_model_on_the_same_batches(synthetic):
    """graphs "compile": the plain-torch GPT under torch.compile; its first microbatch's loss is
    the uncompiled model's on the same batch (inductor may fuse the bf16 math differently)."""
    cfg = dataclasses.replace(TINY, layers=1, vocab=synthetic.vocab_size)
    spec = RunSpec("llama-tiny", cfg, "bf16", "compile", microbatches=1, device="cpu")
    run = Run(spec, synthetic)
    eager = copy.deepcopy(run.model)
    run.prepare()
    assert isinstance(run.blocks, torch._dynamo.eval_frame.OptimizedModule)
    inputs, targets, _ = split_windows(synthetic.train_batch(0, 0, cfg.batch, cfg.seq_len))
    loss = run.train_step(2)
    torch.testing.assert_close(loss, eager(inputs, targets), rtol=1e-2, atol=0)
    assert run.step == 1 and not torch.equal(run.model.head.weight, eager.head.weight)


def test_compare_names_the_compiled_baseline(tmp_path, capsys):
    """--compare bf16:compile,bf16:graphs,fp8:graphs: one tiny compiled step beside graphfp8's
    runs; summary.json names the compiled run as every run's baseline, with the speed fields."""
    argv = ["--preset", "llama-tiny", "--layers", "1", "--batch", "2", "--seq-len", "32",
            "--microbatches", "1", "--steps", "3", "--log-every", "1", "--val-fraction", "0",
            "--data", "synthetic", "--device", "cpu", "--out", str(tmp_path),
            "--compare", "bf16:graphs,bf16:compile,fp8:graphs"]  # fmt: skip
    assert train.main(argv) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["baseline"] == "bf16-torch-compile"
    for r in summary["runs"]:
        assert r["baseline"] == "bf16-torch-compile"
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / summary["runs"][1]["tokens_per_s"])
        assert 0 < r["floor_fraction"] and 0 < r["model_tflops"]
        assert r["tokens_per_s_spread"]["n"] == 2  # the steady log intervals: steps 2 and 3
        assert r["tokens_per_s_spread"]["min"] <= r["tokens_per_s_spread"]["max"]
        assert abs(r["losses"][0] - math.log(256)) < 0.1
    peers = {r["name"]: r["peer"] for r in summary["runs"]}
    assert peers["bf16-torch-compile"]["compiled"] == "whole model"
    assert peers["fp8-graphs"]["graphed"] == "blocks" and peers["fp8-graphs"]["compiled"] == "no"
    out = capsys.readouterr().out
    assert "baseline: bf16-torch-compile" in out and "model TF/s" in out


@pytest.mark.parametrize("graphs", ["layers", "step"])
def test_staged_batches_give_the_same_bits(device, synthetic, graphs):
    """--stage-batches: the same losses and weights bit for bit, step after step (the next step's
    batches staged while a step runs, a validation-free run of 3 steps)."""
    cfg = dataclasses.replace(PRESETS["tiny"], batch=2, seq_len=32)
    runs = []
    for staged in (False, True):
        spec = RunSpec("tiny", cfg, "fp8", graphs, microbatches=2, device=device,
                       stage_batches=staged)  # fmt: skip
        run = Run(spec, synthetic)
        run.prepare()
        runs.append((run, [run.train_step(3) for _ in range(3)]))
    (plain, plain_losses), (staged, staged_losses) = runs
    assert staged.batches._staged is None  # nothing staged past the last step
    for a, b in zip(plain_losses, staged_losses, strict=True):
        assert_bitwise_equal(b, a)
    for (name, a), b in zip(plain.model.state_dict().items(), staged.model.state_dict().values(),
                            strict=True):  # fmt: skip
        if isinstance(a, torch.Tensor):
            assert_bitwise_equal(b, a, name)


def test_stager_takes_what_was_staged_for_that_step_only():
    reads = []

    def read(step, mb):
        reads.append((step, mb))
        return (torch.full((1, 3), 10 * step + mb),)

    stager = BatchStager(read, 2, "cpu", ahead=True)
    stager.stage(1)
    assert reads == [(1, 0), (1, 1)]
    assert [b[0][0, 0].item() for b in stager.take(1)] == [10, 11] and len(reads) == 2
    stager.stage(2)
    assert [b[0][0, 0].item() for b in stager.take(5)] == [50, 51]  # not step 2's: read now
    assert [b[0][0, 0].item() for b in stager.take(2)] == [20, 21]  # nothing staged any more
