"""graphfp8.te: TransformerEngine's names, arguments and defaults over graphfp8. Layers equal the
graphfp8 layers they wrap, TE's layouts and names map exactly, dropout runs graphed == eager bit
for bit, make_graphed_callables takes both of TE's spellings, and every TE argument graphfp8 does
not implement raises naming it (at TE's default it is accepted)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
import graphfp8.te as te
from graphfp8.te import _args, attention, modules, quantization, transformer
from graphfp8.te.recipe import DelayedScaling, Float8CurrentScaling, Format
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import compare_models

H, HEADS, FFN, S, B = 64, 4, 128, 16, 2
BF16 = torch.bfloat16
RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4, amax_compute_algo="max")


def test_recipes_are_graphfp8s():
    r = DelayedScaling(margin=0, fp8_format=Format.E4M3, amax_history_len=16)
    assert r == g8.DelayedScaling(fp8_format=g8.Format.E4M3, amax_history_len=16)
    assert isinstance(r, DelayedScaling) and not isinstance(r, Float8CurrentScaling)
    assert Float8CurrentScaling() == g8.Float8CurrentScaling()
    assert isinstance(g8.Float8CurrentScaling(), te.recipe.Float8CurrentScaling)
    with pytest.raises(NotImplementedError, match="scaling_factor_compute_algo"):
        DelayedScaling(scaling_factor_compute_algo=lambda *a: None)
    with pytest.raises(NotImplementedError, match="fp8_gemm_fprop"):
        Float8CurrentScaling(fp8_gemm_fprop=object())
    with pytest.raises(NotImplementedError, match="use_power_2_scales=True"):
        Float8CurrentScaling(use_power_2_scales=True)


def test_float8_block_scaling(monkeypatch):
    """TE's Float8BlockScaling: graphfp8's, power-of-2 scales unless TE's environment switch
    asks for float32 scales; a layer under it runs the blockwise GEMMs."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    r = te.recipe.Float8BlockScaling()
    assert r == g8.Float8BlockScaling() and isinstance(r, te.recipe.Float8BlockScaling)
    assert not isinstance(r, Float8CurrentScaling)
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert te.recipe.Float8BlockScaling() == g8.Float8BlockScaling(power_2_scale=False)
    with pytest.raises(NotImplementedError, match="fp8_quant_fwd_weight"):
        te.recipe.Float8BlockScaling(fp8_quant_fwd_weight=object())
    layer = te.Linear(128, 128, params_dtype=torch.float32, device="cpu")
    x = torch.randn(16, 128)
    with te.autocast(recipe=te.recipe.Float8BlockScaling()):
        y = layer(x)
    with g8.fp8_autocast(recipe=g8.Float8BlockScaling(power_2_scale=False)):
        assert_bitwise_equal(y, layer(x))


def test_te_defaults():
    """TE's initialisation (N(0, 0.023), zero biases), its device (the CPU without CUDA) and
    parameter names."""
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(256, 512, params_dtype=torch.float32)
    assert abs(mlp.fc1_weight.std().item() - 0.023) < 1e-3 and not mlp.fc2_bias.any()
    assert mlp.fc1_weight.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    lnl = te.LayerNormLinear(H, H, device="cpu")
    assert {n for n, _ in lnl.named_parameters()} == {
        "layer_norm_weight", "layer_norm_bias", "weight", "bias"}  # fmt: skip
    layer = te.TransformerLayer(H, FFN, HEADS, device="cpu")
    assert layer.self_attention.core_attention.attention_dropout == 0.1 == layer.hidden_dropout
    with pytest.raises(AttributeError, match="graphfp8.te has no 'MultiheadAttention'"):
        te.MultiheadAttention  # noqa: B018


def test_norms_equal_torchs():
    x = torch.randn(4, H)
    ln = te.LayerNorm(H, eps=1e-6, zero_centered_gamma=True, device="cpu")
    torch.nn.init.normal_(ln.weight)
    want = torch.nn.functional.layer_norm(x, (H,), ln.weight + 1, ln.bias, 1e-6)
    assert_bitwise_equal(ln(x), want)
    rms = te.RMSNorm(hidden_size=H, device="cpu")
    assert_bitwise_equal(rms(x), torch.nn.functional.rms_norm(x, (H,), rms.weight, 1e-5))


def _g8_twin(layer: te.TransformerLayer) -> g8.TransformerLayer:
    """graphfp8's TransformerLayer (no RoPE) holding a copy of `layer`'s weights."""
    twin = g8.TransformerLayer(H, HEADS, FFN, rope=False, params_dtype=BF16, device="cpu")
    attn = layer.self_attention
    for mine, theirs in ((twin.qkv, attn.layernorm_qkv), (twin.proj, attn.proj),
                         (twin.mlp, layer.layernorm_mlp)):  # fmt: skip
        mine.load_state_dict(theirs.state_dict())
    return twin


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_transformer_layer_is_graphfp8s(fmt):
    """Without dropout, te.TransformerLayer is graphfp8.TransformerLayer(rope=False) in TE's
    layout: the same outputs and gradients, bit for bit, over FP8 steps."""
    layer = te.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=BF16, device="cpu",
                                attn_input_format=fmt)  # fmt: skip
    twin = _g8_twin(layer)
    for step in range(2):
        x = torch.randn(S, B, H, dtype=BF16)
        xt = x.transpose(0, 1).contiguous()
        with te.autocast(recipe=RECIPE):
            y = layer(x if fmt == "sbhd" else xt, is_first_microbatch=step == 0)
            yt = twin(xt, is_first_microbatch=step == 0)
        y.float().square().sum().backward()
        yt.float().square().sum().backward()
        assert_bitwise_equal(y.transpose(0, 1) if fmt == "sbhd" else y, yt)
    assert_bitwise_equal(layer.layernorm_mlp.fc1_weight.grad, twin.mlp.fc1_weight.grad)
    assert_bitwise_equal(layer.self_attention.layernorm_qkv.weight.grad, twin.qkv.weight.grad)


def test_dot_product_attention_sbhd():
    dpa = te.DotProductAttention(HEADS, 16, attention_dropout=0.0, device="cpu")
    core = g8.DotProductAttention(HEADS, 16)
    q, k, v = (torch.randn(S, B, HEADS, 16, dtype=BF16) for _ in "qkv")
    want = core(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    assert_bitwise_equal(dpa(q, k, v, attention_mask=None), want)
    assert_bitwise_equal(dpa(*(t.transpose(0, 1) for t in (q, k, v)), qkv_format="bshd"),
                         want.transpose(0, 1))  # fmt: skip
    with pytest.raises(NotImplementedError, match="attention_mask"):
        dpa(q, k, v, torch.ones(B, 1, S, S, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="per-call mask type 'padding'"):
        dpa(q, k, v, attn_mask_type="padding")
    with pytest.raises(NotImplementedError, match="qkv_format='thd'"):
        te.DotProductAttention(HEADS, 16, qkv_format="thd")


def _train_dropout_layer(graphed: bool, steps: int = 3, mbs: int = 2):
    """A te.TransformerLayer with TE's default dropout (0.1 both) trained eagerly or graphed
    from the same seed: (outputs, model)."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(H, FFN, HEADS, params_dtype=BF16, device="cpu")
    sample = torch.randn(S, B, H, dtype=BF16, requires_grad=True)
    call = layer
    if graphed:
        call = te.make_graphed_callables(layer, (sample,), enabled=True, recipe=RECIPE,
                                         cache_quantized_params=True)  # fmt: skip
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    torch.manual_seed(1)
    outs = []
    for _ in range(steps):
        for mb in range(mbs):
            x = torch.randn(S, B, H, dtype=BF16, requires_grad=True)
            with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
                y = call(x, is_first_microbatch=mb == 0)
            y.float().square().sum().backward()
            outs.append(y.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs, layer


def test_dropout_graphed_equals_eager():
    """TE's default dropout draws from torch's generator: the replays draw what eager mode
    draws (CPU tape here; CUDA graphs register the generator's state the same way)."""
    eager_out, eager = _train_dropout_layer(graphed=False)
    graphed_out, graphed = _train_dropout_layer(graphed=True)
    for i, (a, b) in enumerate(zip(eager_out, graphed_out, strict=True)):
        assert_bitwise_equal(b, a, f"microbatch {i}")
    compare_models(eager, graphed, "after training")
    eager.eval()
    x = torch.randn(S, B, H, dtype=BF16)
    assert torch.equal(eager(x), eager(x))  # eval: no dropout
    eager.train()
    assert not torch.equal(eager(x), eager(x))


def test_make_graphed_callables_spellings():
    layer = te.Linear(H, H, params_dtype=BF16, device="cpu")
    sample = (torch.randn(S, H, dtype=BF16, requires_grad=True),)
    with pytest.raises(ValueError, match="deprecated `fp8_recipe` kwarg in favor of `recipe`"):
        te.make_graphed_callables(layer, sample, fp8_recipe=RECIPE, recipe=RECIPE)
    with pytest.raises(ValueError, match="one entry per callable"):
        te.make_graphed_callables((layer, copy.deepcopy(layer)), (sample, sample),
                                  enabled=(True, False, True))  # fmt: skip
    with pytest.raises(NotImplementedError, match="retain_graph_in_backward=True"):
        te.make_graphed_callables(layer, sample, retain_graph_in_backward=True)
    with pytest.raises(NotImplementedError, match="calibrating=True"):
        te.make_graphed_callables(layer, sample, fp8_calibrating=True)
    eager = copy.deepcopy(layer)
    graphed = te.make_graphed_callables(layer, sample, fp8_enabled=True, fp8_recipe=RECIPE,
                                        fp8_weight_caching=True)  # fmt: skip
    for mb in range(3):  # TE's older names: the same capture as enabled / recipe / cache_...
        x = torch.randn(S, H, dtype=BF16, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=RECIPE):
            want = eager(x, is_first_microbatch=mb == 0)
        assert_bitwise_equal(graphed(x, is_first_microbatch=mb == 0), want)


def test_make_graphed_callables_enabled_per_callable():
    """TE's per-callable `enabled` tuple: the bf16 layer runs as eagerly outside FP8."""
    layers = [te.Linear(H, H, params_dtype=BF16, device="cpu") for _ in range(2)]
    eager = copy.deepcopy(layers)
    sample = (torch.randn(S, H, dtype=BF16, requires_grad=True),)
    graphed = te.make_graphed_callables(tuple(layers), (sample, sample), enabled=(False, True),
                                        recipe=RECIPE)  # fmt: skip
    for _ in range(2):
        x = torch.randn(S, H, dtype=BF16, requires_grad=True)
        with te.autocast(enabled=False):
            want = eager[0](x)
        with te.autocast(enabled=True, recipe=RECIPE):
            want = eager[1](want)
        assert_bitwise_equal(graphed[1](graphed[0](x)), want)


def test_fp8_model_init():
    with te.fp8_model_init(enabled=True, recipe=RECIPE):
        layer = te.LayerNormMLP(H, FFN, params_dtype=BF16, device="cpu")
    assert isinstance(layer.fc1_weight, g8.Float8Tensor)
    with pytest.raises(NotImplementedError, match="preserve_high_precision_init_val=True"):
        te.quantized_model_init(preserve_high_precision_init_val=True)


# Every table of TE-only arguments: at TE's defaults accepted, otherwise NotImplementedError.
TABLES = {
    "Linear": (lambda **kw: te.Linear(H, H, device="cpu", **kw), modules._LINEAR_TE_ONLY),
    "LayerNormLinear": (lambda **kw: te.LayerNormLinear(H, H, device="cpu", **kw),
                        modules._LNLINEAR_TE_ONLY),
    "LayerNormMLP": (lambda **kw: te.LayerNormMLP(H, FFN, device="cpu", **kw),
                     modules._MLP_TE_ONLY),
    "DotProductAttention": (lambda **kw: te.DotProductAttention(HEADS, 16, device="cpu", **kw),
                            attention._DPA_TE_ONLY),
    "TransformerLayer": (lambda **kw: te.TransformerLayer(H, FFN, HEADS, device="cpu", **kw),
                         transformer._LAYER_TE_ONLY),
    "make_graphed_callables": (
        lambda **kw: quantization.check_te_args("make_graphed_callables", kw,
                                                quantization._GRAPH_TE_ONLY),
        quantization._GRAPH_TE_ONLY,
    ),
}  # fmt: skip


@pytest.mark.parametrize("where", sorted(TABLES))
def test_te_only_arguments(where):
    make, table = TABLES[where]
    make(**table)  # every TE-only argument at its default
    name = next(n for n in sorted(table) if n not in _args.UB)
    other = "something else" if table[name] is None else not table[name]
    with pytest.raises(NotImplementedError, match=f"{where}: {name}="):
        make(**{name: other})
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_argument'"):
        make(no_such_argument=1)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: te.Linear(H, H, device="cpu")(torch.randn(S, H), fp8_output=True),
         "Linear.forward: fp8_output=True"),
        (lambda: te.TransformerLayer(H, FFN, HEADS, device="cpu")(
            torch.randn(S, B, H), rotary_pos_emb=torch.ones(S, 1, 1, 16)), "rotary_pos_emb="),
        (lambda: te.TransformerLayer(H, FFN, HEADS, fuse_qkv_params=True, device="cpu"),
         "qkv_weight_interleaved=False"),
        (lambda: te.LayerNormMLP(H, FFN, activation="srelu"), "activation must be one of"),
        (lambda: te.autocast(_graph=True), "_graph=True"),
        (lambda: te.fp8_autocast(calibrating=True), "calibrating=True"),
    ],
)  # fmt: skip
def test_unsupported_calls_raise(call, match):
    with pytest.raises((NotImplementedError, ValueError), match=match):
        call()


def test_format_e5m2_is_named_not_a_bare_attribute_error():
    """Issue 39: `Format.E5M2` raised a bare AttributeError: E5M2. Now TE's member exists, and a
    recipe made with it says what graphfp8 runs instead; TE's other members give graphfp8's."""
    with pytest.raises(NotImplementedError, match=r"Format.E5M2 .* use Format.HYBRID"):
        DelayedScaling(fp8_format=Format.E5M2)
    with pytest.raises(NotImplementedError, match=r"Format.E5M2"):
        Float8CurrentScaling(fp8_format=Format.E5M2)
    assert Float8CurrentScaling(fp8_format=Format.E4M3).fp8_format is g8.Format.E4M3
    assert DelayedScaling(fp8_format=g8.Format.E4M3).fp8_format is g8.Format.E4M3


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_linear_takes_a_bf16_input_on_float32_weights(fp8):
    """Issue 39: te.Linear refused a bf16 input on float32 weights, where TE casts the weights
    (its activation dtype is the input's). Now it computes as under torch.autocast(bf16): the
    same FP8 GEMMs as a float32 input of the same values, the output in bf16, float32 grads."""
    torch.manual_seed(0)
    layer = te.Linear(H, H, device="cpu")
    twin = copy.deepcopy(layer)
    x = torch.randn(S * B, H).to(BF16)
    with te.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
        y = layer(x, is_first_microbatch=True)
        want = twin(x.float(), is_first_microbatch=True) if fp8 else None
    assert y.dtype == BF16
    if fp8:
        assert_bitwise_equal(y, want.to(BF16))
    else:
        assert_bitwise_equal(y, torch.nn.functional.linear(x, layer.weight.to(BF16),
                                                           layer.bias.to(BF16)))  # fmt: skip
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32


def test_linear_reset_parameters():
    """Issue 39: te.Linear had no reset_parameters (TE's modules do): the weight from
    init_method again, the bias 0."""
    torch.manual_seed(3)
    want = te.Linear(H, H, device="cpu")
    layer = te.Linear(H, H, device="cpu")
    with torch.no_grad():
        layer.bias.fill_(1.0)
    torch.manual_seed(3)
    layer.reset_parameters()
    assert_bitwise_equal(layer.weight, want.weight)
    assert_bitwise_equal(layer.bias, torch.zeros_like(layer.bias))
