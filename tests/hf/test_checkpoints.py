"""Checkpoints every framework writes and reads (issue 32, item 1): the FP8 state is a tensor, so
safetensors, torch.distributed.checkpoint and accelerate's save_model / save_state (both
serialisations) take a converted model, and training resumes from each bit for bit; a state dict
without FP8 state loads with strict=True as fresh FP8 state."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.hf.common import assert_same_training, fp8_model, hf_model, ids, train

accelerate = pytest.importorskip("accelerate")


def _resumed(kind: str, save, load):
    """Trains 2 steps, saves (model, optimizer) with `save(lm, opt)`, trains 2 more; a fresh
    model (other weights) loads with `load(fresh, fresh_opt, saved)` and trains the same 2 steps:
    losses, weights and FP8 state must be equal bit for bit."""
    lm, opt = fp8_model(kind)
    train(lm, opt, 2)
    saved = save(lm, opt)
    want = train(lm, opt, 2, start=2)
    fresh, fresh_opt = fp8_model(kind, seed=9)
    load(fresh, fresh_opt, saved)
    got = train(fresh, fresh_opt, 2, start=2)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"loss {i} after resuming")
    assert_same_training(lm, fresh, "after resuming")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_safetensors_resume(kind, tmp_path):
    """safetensors (tied embeddings through save_model) - failed before: expected torch.Tensor
    but received dict."""

    def save(lm, opt):
        safetensors.torch.save_model(lm, tmp_path / "m.safetensors")
        torch.save(opt.state_dict(), tmp_path / "opt.pt")

    def load(lm, opt, _):
        safetensors.torch.load_model(lm, tmp_path / "m.safetensors", strict=True)
        opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))

    _resumed(kind, save, load)


def test_weights_only_resume(tmp_path):
    def save(lm, opt):
        torch.save({"model": lm.state_dict(), "opt": opt.state_dict()}, tmp_path / "c.pt")

    def load(lm, opt, _):
        state = torch.load(tmp_path / "c.pt", weights_only=True)
        lm.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])

    _resumed("llama", save, load)


def test_distributed_checkpoint_resume(tmp_path):
    """torch.distributed.checkpoint loads into the tensors of the fresh model's state dict: a
    model carrying its recipe has its FP8 state at its final size from the start."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")

    def save(lm, opt):
        dcp.save({"model": lm.state_dict()}, checkpoint_id=tmp_path / "dcp")
        torch.save(opt.state_dict(), tmp_path / "opt.pt")

    def load(lm, opt, _):
        state = {"model": lm.state_dict()}
        dcp.load(state, checkpoint_id=tmp_path / "dcp")
        lm.load_state_dict(state["model"])
        opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))

    _resumed("qwen2", save, load)


@pytest.mark.parametrize("safe", [True, False])
def test_accelerate_save_state_resume(safe, tmp_path):
    """accelerator.save_state / load_state in both serialisations (safetensors failed before)."""

    def save(lm, opt):
        acc = accelerate.Accelerator(cpu=True)
        acc.prepare(lm, opt)
        acc.save_state(tmp_path / "state", safe_serialization=safe)

    def load(lm, opt, _):
        acc = accelerate.Accelerator(cpu=True)
        acc.prepare(lm, opt)
        acc.load_state(tmp_path / "state")

    _resumed("llama", save, load)


@pytest.mark.parametrize("safe", [True, False])
def test_accelerate_save_model(safe, tmp_path):
    lm, opt = fp8_model("qwen2")
    train(lm, opt, 1)
    acc = accelerate.Accelerator(cpu=True)
    acc.save_model(lm, tmp_path, safe_serialization=safe)
    fresh, _ = fp8_model("qwen2", seed=9)
    accelerate.load_checkpoint_in_model(fresh, tmp_path)
    assert_same_training(lm, fresh, "save_model")


def test_a_hugging_face_state_dict_loads_strictly_as_fresh_fp8_state():
    """Into the converted model (HF names: q/k/v fused again) and into an HF model converted in
    place by g8.convert (failed before: missing _extra_state keys with strict=True)."""
    source = hf_model("llama", seed=3)
    lm, opt = fp8_model("llama")
    train(lm, opt, 1)
    lm.load_state_dict(source.state_dict())
    for name, t in g8.to_hf(lm).items():
        assert_bitwise_equal(t, source.state_dict()[name], name)
    state = lm.layers[0].qkv.fp8_meta
    assert_bitwise_equal(state.fwd.scales(), torch.ones_like(state.fwd.scales()), "fresh scales")
    inplace = g8.convert(hf_model("llama", seed=4))
    inplace.load_state_dict(source.state_dict(), strict=True)
    with torch.no_grad(), g8.fp8_autocast(recipe=g8.DelayedScaling()):
        inplace(ids())
    assert_bitwise_equal(inplace.model.layers[0].self_attn.q_proj.weight,
                         source.model.layers[0].self_attn.q_proj.weight)  # fmt: skip


def test_save_pretrained_of_a_model_converted_in_place(tmp_path):
    """g8.convert(hf_model): Hugging Face's own save_pretrained writes the FP8 state beside the
    weights (failed before: expected torch.Tensor but received dict); from_pretrained gives the
    same weights, and the converted model resumes its FP8 state from the directory."""
    model = g8.convert(hf_model("llama").train(), recipe=g8.DelayedScaling(amax_history_len=4))
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 1)
    model.save_pretrained(tmp_path)
    loaded = hf_model("llama").__class__.from_pretrained(tmp_path)
    for name, t in model.state_dict().items():
        if not name.endswith("_extra_state"):
            assert_bitwise_equal(loaded.state_dict()[name], t, name)
    again = g8.convert(
        hf_model("llama", seed=7).train(), recipe=g8.DelayedScaling(amax_history_len=4)
    )
    again.load_state_dict(safetensors.torch.load_file(tmp_path / "model.safetensors"))
    assert_same_training(model, again, "reloaded")
