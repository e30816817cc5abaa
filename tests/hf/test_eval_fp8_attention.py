"""Evaluation and generate() with FP8 attention (a carried recipe with fp8_dpa; issue 39, item 2):
an evaluation forward and generate() after each step, eager or with graphs="layers", and
Lightning's validation loop under FP8Precision, leave training bit for bit where the run without
them ends, and graphed equals eager. Failed before: the attention's eval calls recorded amaxes and
moved the scales, and generate() raised (its KV cache takes the explicit attention path, which
refused fp8_dpa also in eval mode)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from tests.hf.common import assert_same_training, batch, hf_model, ids

DPA = g8.DelayedScaling(amax_history_len=4, fp8_dpa=True)
STEPS, MICRO = 2, 2


def _evaluate_and_generate(model) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad():
        out = [model(ids(7), labels=ids(7)).loss]
    out.append(model.generate(ids(8)[:, :8], max_new_tokens=3, do_sample=False))
    model.train()
    return out


def _run(graphs, evaluate: bool):
    """STEPS x MICRO microbatches of a carried model with fused AdamW (the libraries' default),
    an evaluation forward and generate() after each step when `evaluate`. Returns (model, the
    training losses, the evaluation outputs)."""
    model = g8.from_hf(hf_model("llama").train(), recipe=DPA, graphs=graphs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses, evals = [], []
    for step in range(STEPS):
        for mb in range(MICRO):
            x = batch(step, mb)
            loss = model(x, labels=x).loss
            (loss / MICRO).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        if evaluate:
            evals += _evaluate_and_generate(model)
    return model, losses, evals


def _same(a, b, what: str) -> None:
    for i, (x, y) in enumerate(zip(a[1], b[1], strict=True)):
        assert torch.equal(x, y), f"{what}: loss {i}: {x} != {y}"
    assert_same_training(a[0], b[0], what)


@pytest.mark.parametrize("graphs", [None, "layers"])
def test_evaluation_and_generate_leave_fp8_attention_training_as_it_was(graphs):
    plain, evaluated = _run(graphs, False), _run(graphs, True)
    assert evaluated[0].layers[0].core_attention.fp8_meta is not None, "attention ran in FP8"
    _same(evaluated, plain, f"graphs={graphs}: with evaluation and generate()")
    if graphs == "layers":
        assert evaluated[0].layer_graphs.counts["replayed"] > 0, "the layers replayed graphs"
        eager = _run(None, True)
        _same(evaluated, eager, "graphed == eager")
        for i, (g, e) in enumerate(zip(evaluated[2], eager[2], strict=True)):
            assert torch.equal(g, e), f"graphed == eager: evaluation output {i}"


def test_lightning_validation_leaves_fp8_attention_training_as_it_was():
    """Lightning's validation loop under FP8Precision with an fp8_dpa recipe, a converted model
    (its attention a graphfp8 DotProductAttention): a validation batch after every step, the run
    ends bit for bit where the run without validation does."""
    L = pytest.importorskip("lightning")
    from graphfp8.lightning import FP8Precision

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = g8.from_hf(hf_model("llama").train())

        def training_step(self, x, i):
            return self.model(x, labels=x).loss

        def validation_step(self, x, i):
            return self.model(x, labels=x).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    runs = []
    for validate in (True, False):
        lit = LitLM()
        loader = torch.utils.data.DataLoader(
            [batch(i // MICRO, i % MICRO) for i in range(STEPS * MICRO)], batch_size=None
        )
        val = torch.utils.data.DataLoader([ids(7)], batch_size=None)
        L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0,
                  accumulate_grad_batches=MICRO, val_check_interval=MICRO,
                  limit_val_batches=1 if validate else 0,
                  plugins=[FP8Precision(recipe=DPA)]).fit(lit, loader, val)  # fmt: skip
        runs.append(lit.model)
    assert runs[0].layers[0].core_attention.fp8_meta is not None, "attention ran in FP8"
    assert_same_training(runs[1], runs[0], "with and without validation")
