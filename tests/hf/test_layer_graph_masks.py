"""graphs="layers" on the batches a tokenizer makes (issue 39, item 3): the padding mask is a
device input of the layer graphs, so all-ones, right- and left-padded masks replay, bit for bit
the model without graphs; a forward the graphs cannot take runs eagerly, is said once and
counted (model.layer_graphs.counts)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.hf.common import RECIPE, assert_same_training, batch, hf_model


def padded(step: int, mb: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """A batch and its tokenizer mask: all ones, right padding, then left padding too."""
    x = batch(step, mb, device)
    mask = torch.ones_like(x)
    if mb == 1:
        mask[0, -5:] = 0
    if step == 1:
        mask[1, :3] = 0
    return x, mask


def train_masked(model, batches) -> tuple[list[torch.Tensor], list[str]]:
    """3 steps of 2 microbatches of `batches(step, mb)` -> (x, mask or None); losses, warnings."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            for mb in range(2):
                x, mask = batches(step, mb)
                labels = x if mask is None else x.masked_fill(mask == 0, -100)
                loss = model(x, attention_mask=mask, labels=labels).loss
                (loss / 2).backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
    return losses, [str(w.message) for w in said if "graphfp8" in str(w.message)]


def against_eager(kind: str, batches, device="cpu"):
    """The graphed model's counts and warnings; its losses and state equal the eager model's."""
    graphed = g8.from_hf(hf_model(kind, device=device).train(), recipe=RECIPE, graphs="layers")
    eager = g8.from_hf(hf_model(kind, device=device).train(), recipe=RECIPE)
    got, said = train_masked(graphed, batches)
    want, _ = train_masked(eager, batches)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"loss {i}")
    assert_same_training(eager, graphed, "after 3 steps")
    return graphed.layer_graphs.counts, said


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tokenizer_masks_replay_the_layer_graphs(kind, device):
    counts, said = against_eager(kind, functools.partial(padded, device=device), device)
    assert counts == {"replayed": 6, "eager": 0, "eager_reasons": {}} and said == []


def test_a_forward_the_graphs_cannot_take_runs_eagerly_said_once_and_counted():
    """No mask after masked batches, and an epoch's last partial batch: eager, equal to the model
    without graphs (the weight cache decided once for both paths), one warning per reason."""

    def batches(step, mb):
        x, mask = padded(step, mb)
        if step >= 1 and mb == 0:
            return x, None
        return (x[:1], mask[:1]) if step == 2 else (x, mask)

    counts, said = against_eager("llama", batches)
    assert counts["replayed"] == 3 and counts["eager"] == 3, counts
    assert len(said) == 2 and "captured with an attention_mask" in said[0], said
    assert "(1, 32), the graphs were captured for (2, 32)" in said[1], said
