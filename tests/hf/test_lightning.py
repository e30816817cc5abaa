"""Lightning trains a Hugging Face model in FP8 through graphfp8.lightning.FP8Precision (issue 32,
item 3), with no FP8 code in the LightningModule: layers converted by the plugin, every step
equal bit for bit to the loop written with fp8_autocast by hand over accumulate_grad_batches
microbatches, with a fused AdamW (issue 39: it bumps no version counter); validation between
steps leaves training as it was; Fabric takes the same plugin."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

import graphfp8 as g8
from tests.hf.common import RECIPE, assert_same_training, batch, hf_model

L = pytest.importorskip("lightning")
from graphfp8.lightning import FabricFP8Precision, FP8Precision  # noqa: E402

STEPS, MICRO = 3, 2


class LitLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = hf_model("llama").train()

    def training_step(self, x, i):
        return self.model(x, labels=x).loss

    def validation_step(self, x, i):
        return self.model(x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def _batches():
    return [batch(i // MICRO, i % MICRO) for i in range(STEPS * MICRO)]


@contextlib.contextmanager
def first_microbatch(model, flag: bool | None):
    """Calls every graphfp8 layer of `model` with is_first_microbatch=flag (the HF model's own
    forward passes none)."""
    layers = [m for m in model.modules() if isinstance(m, g8.FP8Module) and m.num_gemms]
    for m in layers:
        m.forward = functools.partial(type(m).forward, m, is_first_microbatch=flag)
    try:
        yield
    finally:
        for m in layers:
            del m.forward


def _explicit():
    model = g8.convert(hf_model("llama").train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for i, x in enumerate(_batches()):
        with g8.fp8_autocast(recipe=RECIPE), first_microbatch(model, None):
            loss = model(x, labels=x).loss
        (loss / MICRO).backward()
        if i % MICRO == MICRO - 1:
            opt.step()
            opt.zero_grad()
    return model


def _trainer(**kw):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0,
                     plugins=[FP8Precision(weights_dtype=torch.bfloat16, recipe=RECIPE)],
                     **kw)  # fmt: skip


def test_lightning_trains_in_fp8_as_the_explicit_loop():
    lit = LitLM()
    loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
    _trainer(accumulate_grad_batches=MICRO).fit(lit, loader)
    assert isinstance(lit.model.model.layers[0].mlp.down_proj, g8.Linear)
    assert_same_training(_explicit(), lit.model, "after 3 steps")


def test_validation_between_steps_leaves_training_as_it_was():
    """A validation batch after every optimizer step (in FP8, FP8Precision's forward_context):
    the run ends bit for bit where the run without validation does (issue 39, item 2)."""
    models = []
    for validate in (True, False):
        lit = LitLM()
        loader = torch.utils.data.DataLoader(_batches(), batch_size=None)
        val = torch.utils.data.DataLoader([batch(7, 0)], batch_size=None)
        _trainer(accumulate_grad_batches=MICRO, val_check_interval=MICRO,
                 limit_val_batches=1 if validate else 0).fit(lit, loader, val)  # fmt: skip
        models.append(lit.model)
    assert_same_training(models[1], models[0], "with and without validation")


def test_fabric_takes_the_plugin():
    fabric = L.Fabric(
        accelerator="cpu",
        devices=1,
        plugins=[FabricFP8Precision(weights_dtype=torch.bfloat16, recipe=RECIPE)],
    )
    model = fabric.setup_module(hf_model("llama").train())
    x = batch(0, 0)
    fabric.backward(model(x, labels=x).loss)
    q_proj = model.module.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, g8.Linear) and q_proj.fp8_meta.fwd.history().abs().sum() > 0


def test_recipe_as_transformer_engine_writes_it():
    plugin = FP8Precision(weights_dtype=torch.bfloat16,
                          recipe={"fp8_format": "E4M3", "amax_history_len": 16})  # fmt: skip
    assert plugin.recipe == g8.DelayedScaling(fp8_format=g8.Format.E4M3, amax_history_len=16)


def test_fit_resumes_from_a_checkpoint(tmp_path):
    """Issue 39: fit(ckpt_path=) failed on unexpected `_extra_state` keys (Lightning restores
    the model state before the plugin converts the model). The plugin keeps the FP8 state
    beside the weights and loads it after the conversion: the restored model (weights and FP8
    state) is the saved one bit for bit, and training goes on from it."""
    loader = torch.utils.data.DataLoader(_batches()[:MICRO], batch_size=None)

    def trainer(epochs: int):
        return _trainer(max_epochs=epochs, accumulate_grad_batches=MICRO,
                        default_root_dir=tmp_path)  # fmt: skip

    saved, first = LitLM(), trainer(STEPS - 1)
    first.fit(saved, loader)
    first.save_checkpoint(tmp_path / "a.ckpt")
    assert "graphfp8_fp8_state" in torch.load(tmp_path / "a.ckpt", weights_only=False)
    restored = LitLM()
    trainer(STEPS - 1).fit(restored, loader, ckpt_path=tmp_path / "a.ckpt")
    assert_same_training(saved, restored, "restored from a checkpoint")
    resumed = LitLM()
    trainer(STEPS).fit(resumed, loader, ckpt_path=tmp_path / "a.ckpt")
    weight = resumed.model.model.layers[0].mlp.down_proj.weight
    assert not torch.equal(weight, saved.model.model.layers[0].mlp.down_proj.weight)
