"""graphfp8.from_hf / to_hf on small Hugging Face models built from configs (nothing downloaded):
the converted model's logits equal the original's to bf16 rounding with FP8 off, weights are
moved rather than copied (ties kept), a checkpoint loads back into Hugging Face's layout, and
FP8 training graphed per decoder layer and as one step graph equals eager bit for bit."""

from __future__ import annotations

import io

import pytest
import torch

import graphfp8 as g8
from graphfp8.hf import causal_lm_loss
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw, compare_step, compare_training_state, eager_step
from tests.hf.common import KINDS, RECIPE, B, S, hf_view, transformers
from tests.hf.common import hf_model as _hf
from tests.hf.common import ids as _ids


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_the_original_with_fp8_off(kind):
    hf = _hf(kind)
    ids = _ids()
    with torch.no_grad():
        want = hf(ids).logits
        lm = g8.from_hf(hf)
        got = lm(ids).logits
        again = hf(ids).logits
    assert_bitwise_equal(again, want, "the HF model after conversion")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 4 * ulp


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_moved_not_copied(kind):
    hf = _hf(kind)
    params_before = sum(p.numel() for p in hf.parameters())
    lm = g8.from_hf(hf)
    assert lm.embed is hf.get_submodule(
        "transformer.wte" if kind == "gpt2" else "model.embed_tokens"
    )
    tied = hf.config.tie_word_embeddings
    assert (lm.lm_head.weight is lm.embed.weight) == tied
    storages = {p.untyped_storage().data_ptr() for p in hf.parameters()}
    ours = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    assert storages == ours, "both models hold the same tensors"
    assert sum(p.numel() for p in lm.parameters()) == params_before


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_loads_back_into_hugging_face(kind):
    """A trained step later, the converted model's state_dict (through torch.save/load with
    weights_only, FP8 state included) becomes an HF state dict that a fresh HF model loads with
    every key matched and computes the converted model's logits with."""
    lm = g8.from_hf(_hf(kind))
    ids = _ids()
    with g8.fp8_autocast(recipe=RECIPE):
        causal_lm_loss(lm(ids), ids).backward()
    with torch.no_grad():
        for p in lm.parameters():
            p.sub_(0.01 * p.grad)
    buffer = io.BytesIO()
    torch.save(lm.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    fresh = _hf(kind, seed=5)
    result = fresh.load_state_dict(g8.to_hf(state, fresh.config), strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith((".attn.bias", ".attn.masked_bias")) for k in result.missing_keys)
    with torch.no_grad():
        assert_bitwise_equal(fresh(ids).logits, hf_view(lm)(ids).logits)


def _pair(kind: str = "llama", device="cpu"):
    return (g8.from_hf(_hf(kind, device=device).train()),
            g8.from_hf(_hf(kind, device=device).train()))  # fmt: skip


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fp8_training_graphed_per_decoder_layer_equals_eager(kind, device):
    eager, graphed = _pair(kind, device)
    samples = tuple(
        (torch.randn(B, S, 64, dtype=torch.bfloat16, device=device, requires_grad=True),)
        for _ in graphed.layers
    )
    g8.make_graphed_callables(tuple(graphed.layers), samples, fp8_enabled=True,
                              fp8_recipe=RECIPE, fp8_weight_caching=True)  # fmt: skip
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_g = torch.optim.AdamW(graphed.parameters(), lr=1e-3)
    for step in range(2):
        for mb in range(2):
            ids = _ids(10 * step + mb, device)
            targets = torch.roll(ids, -1, dims=1)
            with g8.fp8_autocast(recipe=RECIPE):
                loss_e = causal_lm_loss(eager(ids, is_first_microbatch=mb == 0), targets)
            loss_g = causal_lm_loss(graphed(ids, is_first_microbatch=mb == 0), targets)
            assert_bitwise_equal(loss_g, loss_e, f"step {step} mb {mb}: loss")
            loss_e.backward()
            loss_g.backward()
        for (name, pe), (_, pg) in zip(eager.named_parameters(), graphed.named_parameters(),
                                       strict=True):  # fmt: skip
            assert_bitwise_equal(pg.grad, pe.grad, f"step {step}: grad {name}")
        for opt in (opt_e, opt_g):
            opt.step()
            opt.zero_grad()


def test_fp8_step_graph_equals_eager(device):
    eager, graphed = _pair("llama", device)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(graphed.parameters(), device)
    ids = torch.stack([_ids(i, device) for i in range(2)])
    targets = torch.roll(ids, -1, dims=2)
    step = g8.make_graphed_step(
        graphed, causal_lm_loss, opt_g, ((ids,), (targets,)), 2, fp8_enabled=True,
        fp8_recipe=RECIPE, num_warmup_iters=3 if device != "cpu" else 1,
    )  # fmt: skip
    for s in range(2):
        batch_ids = torch.stack([_ids(10 + 2 * s + i, device) for i in range(2)])
        batch_t = torch.roll(batch_ids, -1, dims=2)
        result = eager_step(eager, causal_lm_loss, opt_e, (batch_ids, batch_t), 2)
        step(((batch_ids,), (batch_t,)))
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, graphed, opt_e, opt_g, f"after step {s}")


def test_unsupported_models_and_limits():
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        g8.from_hf(transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64)))  # fmt: skip
    lm = g8.from_hf(_hf("mistral"))
    with pytest.raises(ValueError, match="exceed the model's attention window 48"):
        lm(torch.zeros(1, 64, dtype=torch.int64))
