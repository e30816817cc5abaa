"""The FP8 export for serving (graphfp8/hf/fp8_export.py) of a converted model trained in FP8: E4M3
GEMM weights whose dequantization is the trained weight within E4M3 rounding, per-tensor scales
under each reader's names, static input scales from training's FP8 state, every other tensor
unchanged, and blockwise FP8 weights (Float8BlockTensor) exported as stored, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.primary import quantize_block_weight
from graphfp8.fp8.slots import FwdRole, slot_index
from graphfp8.hf.fp8_export import LAYOUTS, fp8_checkpoint, quantize_128x128, quantize_per_tensor
from graphfp8.ops import blockwise as bw
from graphfp8.testing import assert_bitwise_equal, sqnr

transformers = pytest.importorskip("transformers")
load_file = pytest.importorskip("safetensors.torch").load_file

VOCAB, B, S = 128, 2, 32
RECIPE = g8.DelayedScaling(amax_history_len=4)
BF16 = torch.bfloat16
GEMM_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _trained_llama(train: bool = True):
    """A converted 2-layer Llama after 2 FP8 training steps (weights moved, FP8 state set)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model = g8.from_hf(hf)
    if not train:
        return model
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, VOCAB, (B, S + 1))
    for _ in range(2):
        with g8.fp8_autocast(recipe=RECIPE):
            logits = model(ids[:, :-1])
        g8.hf.causal_lm_loss(logits, ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model


def _is_gemm(key: str) -> bool:
    return key.endswith(".weight") and any(f".{n}." in key for n in GEMM_NAMES)


def test_quantize_per_tensor_is_within_e4m3_rounding():
    w = torch.randn(48, 32, dtype=torch.bfloat16) * 3
    w[0, 0] = 0.0
    w_fp8, scale_inv = quantize_per_tensor(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert scale_inv.shape == () and w_fp8.float().abs().max() == 448  # amax -> fp8_max
    err = (w_fp8.float() * scale_inv - w.float()).abs()
    # E4M3: 3 mantissa bits (half an ulp is 2**-4 relative), subnormal steps of 2**-9
    assert (err <= w.float().abs() * 2**-4 + 2**-10 * scale_inv).all()
    zero, zero_scale = quantize_per_tensor(torch.zeros(16, 16))
    assert zero_scale == 1 and not zero.float().any()


@pytest.mark.parametrize("layout", ["transformers", "vllm"])
def test_export_dequantizes_to_the_trained_weights(layout):
    model = _trained_llama()
    hp = {k: v.detach().clone() for k, v in g8.to_hf(model).items()}
    state, quant = fp8_checkpoint(model, layout=layout)
    weight_key, input_key, skip_key = LAYOUTS[layout]
    assert quant == {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": None, skip_key: ["lm_head"]}  # fmt: skip
    gemms = [k for k in hp if _is_gemm(k)]
    assert len(gemms) == 2 * len(GEMM_NAMES)
    for key in gemms:
        module = key[: -len("weight")]
        w_fp8, scale_inv = state[key], state[module + weight_key]
        assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == hp[key].shape
        w = hp[key].float()
        err = (w_fp8.float() * scale_inv - w).abs()
        assert (err <= w.abs() * 2**-4 + 2**-10 * scale_inv).all(), key
        assert module + input_key not in state
    for key, value in hp.items():  # embeddings, norms, LM head: as trained
        if not _is_gemm(key):
            assert_bitwise_equal(state[key], value, key)
    assert len(state) == len(hp) + len(gemms)


def test_static_input_scales_come_from_training():
    model = _trained_llama()
    state, quant = fp8_checkpoint(model, layout="vllm", activation_scheme="static")
    assert quant["activation_scheme"] == "static"
    layer = model.layers[1]
    scales = {"q_proj": (layer.qkv, 0), "v_proj": (layer.qkv, 0), "o_proj": (layer.proj, 0),
              "up_proj": (layer.mlp, 0), "down_proj": (layer.mlp, 1)}  # fmt: skip
    for name, (module, gemm) in scales.items():
        key = f"model.layers.1.{'mlp' if 'p_proj' in name or 'down' in name else 'self_attn'}"
        got = state[f"{key}.{name}.input_scale"]
        want = module.fp8_meta.fwd.scales()[slot_index(FwdRole.INPUT, gemm)].reciprocal()
        assert_bitwise_equal(got, want.reshape(()))
    with pytest.raises(ValueError, match="never ran in FP8"):
        fp8_checkpoint(_trained_llama(train=False), activation_scheme="static")


def test_save_pretrained_fp8_loads_in_transformers(tmp_path):
    """save_pretrained(fp8=True): transformers' layout; AutoModelForCausalLM loads it (on a CPU
    it dequantizes: weight * weight_scale_inv, rounded once to the model's dtype), and
    its logits follow the trained model's within FP8 rounding."""
    model = _trained_llama()
    model.save_pretrained(tmp_path, fp8=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    saved = load_file(tmp_path / "model.safetensors")
    assert not any(k.startswith("graphfp8.") for k in saved)  # no training state for serving
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    hf_params = dict(loaded.named_parameters())
    for key in (k for k in saved if _is_gemm(k)):
        scale_inv = saved[key[: -len("weight")] + "weight_scale_inv"]
        got = hf_params[key].detach()
        assert_bitwise_equal(got, (saved[key].float() * scale_inv).to(got.dtype), key)
    ids = torch.randint(0, VOCAB, (B, S))
    with torch.no_grad():
        ours, theirs = model(ids).logits.float(), loaded(ids).logits.float()
    assert sqnr(ours, theirs) > 20


def test_save_pretrained_fp8_vllm_layout(tmp_path):
    model = _trained_llama()
    g8.hf.save_pretrained(model, tmp_path, fp8="vllm", activation_scheme="static")
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "fp8", "activation_scheme": "static",
                     "weight_block_size": None, "ignored_layers": ["lm_head"]}  # fmt: skip
    saved = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.0.self_attn.q_proj."
    assert saved[prefix + "weight"].dtype == torch.float8_e4m3fn
    assert {prefix + "weight_scale", prefix + "input_scale"} <= set(saved)
    assert not any("scale_inv" in k or "activation_scale" in k for k in saved)
    with pytest.raises(NotImplementedError, match="Conv1D"):
        fp8_checkpoint(g8.from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, embd_pdrop=0.0, resid_pdrop=0.0,
            attn_pdrop=0.0)).to(BF16)))  # fmt: skip


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_before_anything_is_written(tmp_path, bad):
    """Issue 39: a NaN weight was exported as E4M3 NaN without a word (an inf one saturated to
    448): now the export names the weights and writes nothing."""
    model = _trained_llama()
    with torch.no_grad():
        model.layers[1].mlp.fc2_weight[3, 5] = bad
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight'\]; nothing was"):
        model.save_pretrained(tmp_path / "out", fp8=True)
    assert not (tmp_path / "out").exists()


def test_save_pretrained_blockwise_loads_in_transformers(tmp_path):
    """fp8="blockwise": E4M3 weights in 128x128 blocks with float32 weight_scale_inv (DeepSeek-V3's
    layout; partial blocks at these widths), the fine-grained quantization_config; transformers'
    loader dequantizes each block on the CPU to exactly what the blocks say."""
    model = _trained_llama()
    hp = {k: v.detach().clone() for k, v in g8.to_hf(model).items()}
    g8.hf.save_pretrained(model, tmp_path, fp8="blockwise")
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128],
                     "modules_to_not_convert": ["lm_head"]}  # fmt: skip
    saved = load_file(tmp_path / "model.safetensors")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    hf_params = dict(loaded.named_parameters())
    gemms = [k for k in saved if _is_gemm(k)]
    assert len(gemms) == 2 * len(GEMM_NAMES)
    for key in gemms:
        w_fp8, scale_inv = saved[key], saved[key[: -len("weight")] + "weight_scale_inv"]
        out, inp = w_fp8.shape
        assert w_fp8.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
        assert scale_inv.shape == (-(-out // 128), -(-inp // 128))
        want = bw.dequantize_blocks(w_fp8, scale_inv)
        assert sqnr(hp[key].float(), want) > 25, key
        got = hf_params[key].detach()
        assert_bitwise_equal(got, want.to(got.dtype), key)
    ids = torch.randint(0, VOCAB, (B, S))
    with torch.no_grad():
        ours, theirs = model(ids).logits.float(), loaded(ids).logits.float()
    assert sqnr(ours, theirs) > 20
    with pytest.raises(ValueError, match="dynamic"):
        fp8_checkpoint(model, layout="blockwise", activation_scheme="static")


def test_quantize_128x128_blocks():
    w = torch.randn(300, 200) * 3
    w[128:256, :128] *= 1000.0  # one block of outliers keeps the others' precision
    w_fp8, scale_inv = quantize_128x128(w)
    assert scale_inv.shape == (3, 2)
    assert (scale_inv[1, 0] > 100 * scale_inv[0, 0]) and torch.isclose(
        scale_inv[0, 0], w[:128, :128].abs().max() / 448, rtol=1e-6
    )
    err = bw.dequantize_blocks(w_fp8, scale_inv) - w
    assert (err.abs() <= w.abs() * 2**-4 + 2**-10 * scale_inv.max()).all()


BLOCK = g8.Float8BlockScaling()


def _block_llama(hidden: int, p2: bool = True, seed: int = 0):
    """A converted 2-layer Llama whose GEMM weights are blockwise FP8 (Float8BlockTensor, as
    fp8_model_init(recipe=Float8BlockScaling()) makes them). hidden 256 (4 heads of 64, 2 KV
    heads): q, k, v have 256, 128, 128 rows and gate, up 384, all whole 128-row blocks; layer
    0's o_proj block (0, 0) has its amax at 227.8 / 128, which its power-of-2 scale 128 rounds
    to 224 in E4M3: quantized again from its values it would take the scale 256."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden // 2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64,
    )  # fmt: skip
    model = g8.from_hf(transformers.LlamaForCausalLM(config).to(BF16))
    for i, layer in enumerate(model.layers):
        for owner, name in ((layer.qkv, "weight"), (layer.proj, "weight"),
                            (layer.mlp, "fc1_weight"), (layer.mlp, "fc2_weight")):  # fmt: skip
            hp = getattr(owner, name).detach().clone()
            if i == 0 and owner is layer.proj:
                hp[0, 0] = 227.8 / 128
            setattr(owner, name, torch.nn.Parameter(quantize_block_weight(hp, p2)))
    return model


def _stored_blocks(model) -> dict[str, Float8BlockTensor]:
    """{HF name: the model's blocks of that weight} (q/k/v and gate/up as row slices)."""
    out = {}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        q, k = layer.qkv.weight.shape[1], layer.qkv.weight.shape[0] // 4
        f = layer.mlp.fc2_weight.shape[1]
        rows = {"self_attn.q_proj": (layer.qkv.weight, 0, q),
                "self_attn.k_proj": (layer.qkv.weight, q, q + k),
                "self_attn.v_proj": (layer.qkv.weight, q + k, q + 2 * k),
                "self_attn.o_proj": (layer.proj.weight, 0, q),
                "mlp.gate_proj": (layer.mlp.fc1_weight, 0, f),
                "mlp.up_proj": (layer.mlp.fc1_weight, f, 2 * f),
                "mlp.down_proj": (layer.mlp.fc2_weight, 0, q)}  # fmt: skip
        for name, (w, a, b) in rows.items():
            out[pre + name] = (w._data[a:b], w._scale_inv[a // 128 : -(-b // 128)])
    return out


@pytest.mark.parametrize("p2", [True, False])
def test_blockwise_fp8_weights_export_their_stored_blocks(tmp_path, p2):
    """Issue 42: the blockwise export of a model whose weights are blockwise FP8 quantized their
    dequantized values again (and to_hf refused to split q/k/v and gate/up, naming FSDP2): the
    block whose max rounds to 224 came out with other bytes (power-of-2 scales), float32 scales
    other values. Now the stored data and scales are written bit for bit, split along whole
    128-row blocks, and transformers' fine-grained FP8 loader dequantizes exactly them."""
    model = _block_llama(256, p2)
    g8.hf.save_pretrained(model, tmp_path, fp8="blockwise")
    saved = load_file(tmp_path / "model.safetensors")
    stored = _stored_blocks(model)
    assert len(stored) == 2 * len(GEMM_NAMES)
    for name, (data, scale_inv) in stored.items():
        assert_bitwise_equal(saved[name + ".weight"].view(torch.uint8), data.view(torch.uint8),
                             name)  # fmt: skip
        assert_bitwise_equal(saved[name + ".weight_scale_inv"], scale_inv, name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    hf_params = dict(loaded.named_parameters())
    for name, (data, scale_inv) in stored.items():
        got = hf_params[name + ".weight"].detach()
        assert_bitwise_equal(got, bw.dequantize_blocks(data, scale_inv).to(got.dtype), name)
    ids = torch.randint(0, VOCAB, (B, S))
    with torch.no_grad(), g8.fp8_autocast(recipe=g8.Float8BlockScaling(power_2_scale=p2)):
        ours = model(ids).logits.float()
    with torch.no_grad():
        theirs = loaded(ids).logits.float()
    assert sqnr(ours, theirs) > 20


def test_to_hf_splits_blockwise_weights_on_whole_blocks_and_loads_them_back():
    """to_hf gives blockwise pieces (views of the stored blocks); load_state_dict of them into
    another blockwise model copies the blocks bit for bit (torch.cat of the pieces would
    dequantize them and the load quantize the values again: the 224 block's bytes change)."""
    model = _block_llama(256)
    hf = g8.to_hf(model)
    for name, (data, scale_inv) in _stored_blocks(model).items():
        piece = hf[name + ".weight"]
        assert isinstance(piece, Float8BlockTensor)
        assert_bitwise_equal(piece._data.view(torch.uint8), data.view(torch.uint8), name)
        assert_bitwise_equal(piece._scale_inv, scale_inv, name)
    other = _block_llama(256, seed=1)
    other.load_state_dict(hf)
    for (name, w), (_, v) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        if isinstance(w, Float8BlockTensor):
            assert_bitwise_equal(v._data.view(torch.uint8), w._data.view(torch.uint8), name)
            assert_bitwise_equal(v._scale_inv, w._scale_inv, name)
        else:
            assert_bitwise_equal(v, w, name)


def test_a_blockwise_split_inside_a_block_is_refused_and_high_precision_saves(tmp_path):
    """hidden 64: q_proj's 64 rows end inside the first 128-row block, so no HF weight could
    hold its blocks: to_hf and the blockwise export refuse naming why (nothing written); the
    high-precision save writes the dequantized values."""
    model = _block_llama(64)
    with pytest.raises(ValueError, match="k_proj.weight starts at row 64, inside a block"):
        g8.to_hf(model)
    with pytest.raises(ValueError, match="dequantize=True"):
        g8.hf.save_pretrained(model, tmp_path / "fp8", fp8="blockwise")
    assert not (tmp_path / "fp8").exists()
    hf = g8.to_hf(model, dequantize=True)
    assert not any(isinstance(t, Float8BlockTensor) for t in hf.values())
    g8.hf.save_pretrained(model, tmp_path / "hp")
    saved = load_file(tmp_path / "hp" / "model.safetensors")
    for key, value in hf.items():
        assert_bitwise_equal(saved[key], value, key)
    assert_bitwise_equal(saved["model.layers.0.self_attn.o_proj.weight"],
                         model.layers[0].proj.weight.dequantize())  # fmt: skip
