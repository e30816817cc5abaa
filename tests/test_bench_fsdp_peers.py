"""benchmarks/fsdp_peers.py's harness on 2 gloo ranks with the tiny preset (not speed: that it
builds, shards, trains on graphfp8-train's data and reports); graphfp8/training/torch_model.py has
graphfp8-train's GPT's parameter count; the torchao peer skips on the CPU with its reason."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor

from benchmarks import fsdp_peers
from graphfp8.training.data import Dataset
from graphfp8.training.model import GPT, PRESETS, count_parameters
from graphfp8.training.sources import open_stream
from graphfp8.training.torch_model import TorchGPT
from tests.rank_pool import run_on_ranks


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_torch_gpt_has_the_presets_parameters(preset):
    cfg = PRESETS[preset]
    assert count_parameters(TorchGPT(cfg)) == count_parameters(GPT(cfg, torch.float32, "cpu"))


def _fsdp2_bf16_runs(rank, device):
    data = Dataset(open_stream("synthetic", None, 1 << 16, 0), val_fraction=0.0)
    cfg = replace(PRESETS["tiny"], batch=2, seq_len=32, vocab=data.vocab_size)
    result = fsdp_peers.measure_peer("fsdp2-bf16", cfg, data, device, steps=2, warmup=1,
                                     microbatches=2, compile_blocks=False,
                                     profile_steps=1)  # fmt: skip
    assert result["peer"] == "fsdp2-bf16" and result["tokens_per_s"] > 0
    assert len(result["losses"]) == 3 and all(0 < x < 10 for x in result["losses"])
    assert 0 < result["host_ms_per_step"] <= result["ms_per_step"]
    # the CPU has no kernels to profile: no busy fraction rather than a made-up one
    assert result["profile"] == {"calls": 1, "kernels_per_call": 0.0, "busy_fraction": None}
    assert result["max_allocated_bytes"] == [None, None]  # per rank; torch.cuda's on a GPU
    skipped = fsdp_peers.measure_peer("torchao-fp8", cfg, data, device, steps=1, warmup=1,
                                      microbatches=1, compile_blocks=False)  # fmt: skip
    assert skipped == {"peer": "torchao-fp8", "skipped": fsdp_peers.torchao_skip_reason(device)}
    assert "CUDA" in skipped["skipped"]


def test_fsdp2_bf16_peer_trains_and_reports():
    run_on_ranks("gloo", _fsdp2_bf16_runs)


def _sharded_per_block(rank, device):
    cfg = replace(PRESETS["tiny"], batch=2, seq_len=32)
    model = fsdp_peers._build("fsdp2-bf16", cfg, device, compile_blocks=False, seed=0)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    w = params["blocks.0.fc1.weight"]
    assert w.to_local().shape[0] == w.shape[0] // 2 and w.dtype == torch.float32


def test_fsdp2_peer_shards_every_parameter():
    run_on_ranks("gloo", _sharded_per_block)
