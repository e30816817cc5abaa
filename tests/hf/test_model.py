"""What g8.from_hf returns is shaped like a Hugging Face model (issue 32, item 2): HF's forward
arguments (attention_mask, labels, position_ids, return_dict) and output type, generate() with a
KV cache in graphfp8's layers, config, save_pretrained that AutoModelForCausalLM loads, and
gradient checkpointing refused naming what to do. Each compares with the HF model in bf16 on the
same weights."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.hf.common import RECIPE, VOCAB, hf_model, hf_view, ids, transformers, ulps

CausalLMOutputWithPast = transformers.modeling_outputs.CausalLMOutputWithPast


def _pair(kind: str, seed: int = 0, device="cpu"):
    """(converted model, an HF model holding the same weights)."""
    lm = g8.from_hf(hf_model(kind, seed, device))
    return lm, hf_view(lm).to(device)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_forward_takes_hugging_face_arguments_and_returns_its_output(kind):
    """Trainer's call: labels give HF's shifted loss; return_dict=False a tuple (failed before:
    forward() got an unexpected keyword argument 'attention_mask'; logits, no .loss)."""
    lm, hf = _pair(kind)
    x = ids()
    labels = x.clone()
    labels[:, :5] = -100
    with torch.no_grad():
        out = lm(input_ids=x, attention_mask=torch.ones_like(x), labels=labels)
        want = hf(input_ids=x, attention_mask=torch.ones_like(x), labels=labels)
        loss, logits = lm(x, labels=labels, return_dict=False)
    assert isinstance(out, CausalLMOutputWithPast)
    assert ulps(out.logits, want.logits) <= 4
    torch.testing.assert_close(out.loss, want.loss, rtol=2e-3, atol=0)
    assert_bitwise_equal(loss, out.loss)
    assert_bitwise_equal(logits, out.logits)
    assert lm.config.model_type == kind


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_mask_equals_hugging_face_on_real_tokens(kind, side):
    lm, hf = _pair(kind)
    x = ids()
    mask = torch.ones_like(x)
    pads = torch.arange(x.shape[1]) >= x.shape[1] - 7 if side == "right" else torch.arange(
        x.shape[1]) < 7  # fmt: skip
    mask[1, pads] = 0
    with torch.no_grad():
        got = lm(x, attention_mask=mask).logits
        want = hf(x, attention_mask=mask).logits
        unpadded = lm(x).logits
    real = mask.bool()
    assert ulps(got[real], want[real]) <= 4
    if side == "left":  # right padding cannot change earlier tokens
        assert not torch.equal(got[1][real[1]], unpadded[1][real[1]]), "the mask did nothing"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_position_ids_equal_hugging_face(kind):
    """DataCollatorWithFlattening's batch: position_ids restart per document, no mask (HF's sdpa
    attention then moves the positions only; segment_ids keep documents apart)."""
    lm, hf = _pair(kind)
    x = ids(batch=1)
    position_ids = torch.cat([torch.arange(12), torch.arange(20)])[None]
    segments = (torch.arange(32) >= 12).long()[None]
    with torch.no_grad():
        got = lm(x, position_ids=position_ids).logits
        want = hf(x, position_ids=position_ids).logits
        apart = lm(x, position_ids=position_ids, segment_ids=segments).logits
        alone = lm(x[:, 12:]).logits
    assert ulps(got, want) <= 4
    assert ulps(apart[:, 12:], alone) <= 2, "with segment_ids the document sees only itself"


def test_gpt2_packed_segments_restart_learned_positions():
    """segment_ids without position_ids: each document gets the positions it has alone (failed
    before: a packed GPT-2 document differed from the same document alone by 8e-2)."""
    lm = g8.from_hf(hf_model("gpt2"))
    x = ids(batch=1)
    segments = torch.cat([torch.zeros(12), torch.ones(20)]).long()[None]
    with torch.no_grad():
        packed = lm(x, segment_ids=segments).logits
        alone = lm(x[:, 12:]).logits
    assert_bitwise_equal(packed[:, 12:], alone, "second document")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_greedy_generate_equals_hugging_face(kind, device):
    """generate() with the KV cache in graphfp8's layers, a left-padded batch (failed before: no
    generate). Logits differ from HF's by bf16 rounding, which can flip an argmax between two
    logits one ulp apart (about one in five of these tiny models has such a tie in 12 tokens):
    these weights have none."""
    lm, hf = _pair(kind, seed=2, device=device)
    x = ids(seq=10, device=device)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = lm.generate(x, **kw)
        want = hf.generate(x, **kw)
    assert got.shape == (2, 22)
    assert_bitwise_equal(got, want, "generated tokens")


def test_sampling_generate_equals_hugging_face():
    lm, hf = _pair("llama", seed=2)
    x = ids(seq=10)
    kw = dict(max_new_tokens=12, do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(7)
        got = lm.generate(x, **kw)
        torch.manual_seed(7)
        want = hf.generate(x, **kw)
    assert_bitwise_equal(got, want, "sampled tokens")


def test_cached_decode_equals_a_full_forward():
    """Prefill then one token at a time through the cache computes what one forward over the
    whole sequence computes (the explicit attention path against the fused one)."""
    lm = g8.from_hf(hf_model("llama"))
    x = ids(seq=20)
    cache = transformers.DynamicCache(config=lm.config)
    with torch.no_grad():
        full = lm(x).logits
        steps = [lm(x[:, :12], cache=cache, past_key_values=cache).logits]
        for t in range(12, 20):
            steps.append(lm(x[:, t : t + 1], past_key_values=cache).logits)
    assert cache.get_seq_length() == 20
    assert ulps(torch.cat(steps, dim=1), full) <= 2


def test_decode_in_fp8(device):
    """A model carrying its recipe generates with FP8 GEMMs (eval in FP8); its first token is the
    argmax of its own FP8 forward."""
    lm = g8.from_hf(hf_model("llama", device=device), recipe=g8.Float8CurrentScaling()).eval()
    x = ids(seq=16, device=device)
    with torch.no_grad():
        out = lm.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
        first = lm(x).logits[:, -1].argmax(-1)
    assert (lm.layers[0].qkv.fp8_meta.fwd.scales() != 1).any(), "its casts ran in FP8"
    assert_bitwise_equal(out[:, 16], first)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_save_pretrained_loads_in_hugging_face(kind, tmp_path):
    """After an FP8 step, model.save_pretrained / g8.hf.save_pretrained write a directory
    AutoModelForCausalLM loads with equal weights (tied embeddings stay tied)."""
    lm = g8.from_hf(hf_model(kind).train(), recipe=RECIPE)
    x = ids()
    lm(x, labels=x).loss.backward()
    with torch.no_grad():
        for p in lm.parameters():
            p.sub_(0.01 * p.grad)
    lm.save_pretrained(tmp_path / "a")
    g8.hf.save_pretrained(lm, tmp_path / "b", fp8_state=False)
    for d in ("a", "b"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d)
        assert type(hf).__name__ == type(hf_view(lm)).__name__ and hf.dtype == torch.bfloat16
        theirs = hf.state_dict()
        for name, t in g8.to_hf(lm).items():
            assert_bitwise_equal(theirs[name], t, f"{d}: {name}")
        assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == (kind != "llama")


@pytest.mark.parametrize("graphs", [None, "layers"])
def test_gradient_checkpointing_gives_the_same_bits(graphs):
    """HF's gradient_checkpointing_enable: every layer recomputes (recompute="full"), the loss
    and every gradient as without; refused once the per-layer graphs are captured."""
    results = []
    for checkpointing in (False, True):
        lm = g8.from_hf(hf_model("llama").train(), recipe=RECIPE, graphs=graphs)
        if checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        assert lm.is_gradient_checkpointing == checkpointing
        x = ids()
        for _ in range(2):
            loss = lm(x, labels=x).loss
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in lm.parameters()]))
    assert_bitwise_equal(results[1][0], results[0][0], "loss")
    for i, (g, w) in enumerate(zip(results[1][1], results[0][1], strict=True)):
        assert_bitwise_equal(g, w, f"grad {i}")
    if graphs == "layers":
        with pytest.raises(RuntimeError, match="before the first training forward"):
            lm.gradient_checkpointing_disable()


def test_vocab_logits_to_keep():
    lm = g8.from_hf(hf_model("llama"))
    x = ids()
    with torch.no_grad():
        assert_bitwise_equal(lm(x, logits_to_keep=1).logits, lm(x).logits[:, -1:])
    assert lm(x).logits.shape[-1] == VOCAB


def test_max_seq_len_past_max_position_embeddings():
    """Issue 39: from_hf(max_seq_len=) was capped at max_position_embeddings (64 here) without a
    word, and generate() raised at position 64 where Hugging Face's rotary model continues.
    Now the tables cover max_seq_len and generate() goes on as HF's; past the tables the error
    names max_seq_len; GPT-2's learned positions refuse a longer max_seq_len."""
    hf = hf_model("llama", seed=2)
    x = ids(seq=8)[:1]
    kw = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False)
    with torch.no_grad():
        want = hf.generate(x, **kw)
        got = g8.from_hf(hf_model("llama", seed=2), max_seq_len=96).generate(x, **kw)
    assert got.shape == (1, 72)
    assert_bitwise_equal(got, want, "generated tokens")
    with pytest.raises(
        ValueError, match=r"position 64 is past the rotary tables of 64 .*max_seq_len="
    ):
        with torch.no_grad():
            g8.from_hf(hf_model("llama")).generate(x, **kw)
    with pytest.raises(ValueError, match=r"learned positions for 64 tokens \(n_positions\)"):
        g8.from_hf(hf_model("gpt2"), max_seq_len=96)


def test_transformers_4_is_refused_at_import():
    """Issue 39: the [hf] extra allowed transformers 4.48, whose generate() failed inside
    graphfp8's forward; the extra now asks for 5.24 and graphfp8.hf refuses 4.x by name."""
    from graphfp8.hf.model import check_transformers

    with pytest.raises(ImportError, match=r"transformers >= 5.24 .* found 4.48.0"):
        check_transformers("4.48.0")
    check_transformers(transformers.__version__)
