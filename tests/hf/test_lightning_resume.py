"""Lightning resume as a whole run (issue 39): fit N steps uninterrupted, against fit k steps, a
Lightning checkpoint (ModelCheckpoint's, the Trainer's default callback) and fit(ckpt_path=) to
N in a fresh Trainer and model - with FP8Precision at its defaults and torch.optim.AdamW at its
own. The losses of every step after k, the weights, the optimizer state and the FP8 state
(histories, scales) are the uninterrupted run's bit for bit. The data of each step is the test's
business: each epoch (one optimizer step) takes batches of its own."""

from __future__ import annotations

import pytest
import torch

from tests.hf.common import assert_same_training, batch, hf_model

L = pytest.importorskip("lightning")
from graphfp8.lightning import FP8Precision  # noqa: E402

N, K, MICRO = 4, 2, 2


class LitLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = hf_model("llama").train()
        self.losses: list[torch.Tensor] = []

    def training_step(self, mb, i):
        # Each epoch's own batches, from the restored epoch counter (a sampler's set_epoch
        # comes after Lightning made the first epoch's iterator: a resumed run would start with
        # epoch 0's data).
        x = batch(self.current_epoch, int(mb))
        loss = self.model(x, labels=x).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def _loader():
    return torch.utils.data.DataLoader(list(range(MICRO)), batch_size=None)


def _fit(root, epochs: int, ckpt_path=None) -> tuple[LitLM, L.Trainer]:
    """One optimizer step per epoch (MICRO microbatches accumulated)."""
    lit = LitLM()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        accumulate_grad_batches=MICRO, default_root_dir=root,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[FP8Precision()])  # fmt: skip
    trainer.fit(lit, _loader(), ckpt_path=ckpt_path)
    return lit, trainer


def _assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(sb["state"][i][key], value), f"optimizer state {i}.{key}"


@pytest.mark.parametrize("saved_by", ["ModelCheckpoint", "save_checkpoint after fit"])
def test_a_resumed_fit_is_the_uninterrupted_run(tmp_path, saved_by):
    whole, whole_trainer = _fit(tmp_path / "whole", N)
    _, first = _fit(tmp_path / "first", K)
    ckpt = first.checkpoint_callback.best_model_path
    assert ckpt.endswith(f"step={K}.ckpt"), ckpt
    if saved_by != "ModelCheckpoint":
        ckpt = tmp_path / "after_fit.ckpt"
        first.save_checkpoint(ckpt)
    resumed, resumed_trainer = _fit(tmp_path / "resumed", N, ckpt_path=ckpt)
    assert resumed_trainer.global_step == whole_trainer.global_step == N
    after = whole.losses[K * MICRO :]
    assert len(resumed.losses) == len(after) == (N - K) * MICRO
    for i, (got, want) in enumerate(zip(resumed.losses, after, strict=True)):
        assert torch.equal(got, want), f"microbatch {K * MICRO + i}: loss {got} != {want}"
    layer = resumed.model.model.layers[0].mlp.down_proj
    assert layer.fp8_meta.fwd.history().abs().sum() > 0, "the resumed run trained in FP8"
    assert_same_training(whole.model, resumed.model, f"resumed at step {K}")  # weights, FP8 state
    _assert_same_optimizer(whole_trainer.optimizers[0], resumed_trainer.optimizers[0])
