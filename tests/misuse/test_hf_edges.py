"""The Hugging Face edges of issue 39 that failed with a confusing error (or none): each now
works as the plain model does, or raises before any state changes naming the fix."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.hf.common import RECIPE, assert_same_training, fp8_model, hf_model, ids


def test_a_batch_of_tokens_not_a_multiple_of_16_names_pad_to_multiple_of():
    """(3, 31) tokens, an unpadded batch or an epoch's last partial one: the error named only the
    weight-gradient GEMM; now it names the collator's pad_to_multiple_of=16, and nothing moved."""
    lm, _ = fp8_model("llama")
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    x = ids(batch=3, seq=31)
    with pytest.raises(ValueError, match=r"got 93: pad .*pad_to_multiple_of=16"):
        lm(x, labels=x)
    assert_same_training(lm, _Snapshot(before), "after the refused batch")


class _Snapshot(torch.nn.Module):
    """A state dict as a module (assert_same_training compares state dicts)."""

    def __init__(self, state: dict):
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):
        return self._state


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_resize_token_embeddings(kind):
    """Issue 39: resize_token_embeddings raised NotImplementedError (set_input_embeddings) on a
    from_hf model. Now it resizes as on the HF model (the same rows, ties kept) and trains."""
    hf = hf_model(kind).train()
    lm = g8.from_hf(hf_model(kind).train(), recipe=RECIPE)
    for model in (hf, lm):
        torch.manual_seed(7)
        model.resize_token_embeddings(144, mean_resizing=False)
    tied = kind != "llama"
    for ours, theirs in ((lm.embed, hf.get_input_embeddings()),
                         (lm.lm_head, hf.get_output_embeddings())):  # fmt: skip
        assert_bitwise_equal(ours.weight, theirs.weight, f"{kind}: resized")
    assert (lm.lm_head.weight is lm.embed.weight) == tied and lm.config.vocab_size == 144
    x = ids()
    out = lm(x, labels=x)
    out.loss.backward()
    assert out.logits.shape[-1] == 144 and lm.embed.weight.grad is not None


def test_capturing_a_model_converted_with_a_recipe_says_what_to_do():
    """Issue 39: convert(model, recipe=) then a capture raised "modules must have no hooks";
    now the error names the carried recipe and the fix (convert without one, recipe to the
    capture)."""
    model = g8.convert(torch.nn.Sequential(torch.nn.Linear(64, 64)), recipe=RECIPE)
    x = torch.randn(16, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"carries its recipe .* convert it without a recipe"):
        g8.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=RECIPE)
