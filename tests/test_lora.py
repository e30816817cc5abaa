"""LoRA on FP8 layers with peft (graphfp8/lora.py): high-precision adapters over a frozen FP8 base
(a high-precision weight cast to FP8, or an FP8 parameter from fp8_model_init), the adapters'
function and gradients exactly base + B(A(x)) * scaling, graphed == eager bit for bit (per-layer
graphs and the whole step), merged weights equal to peft's merge of a torch.nn.Linear, and what
is not supported raising."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
import graphfp8.lora as gl
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import TinyLM, adamw, compare_step, eager_step, lm_batch, lm_loss

peft = pytest.importorskip("peft")

RECIPE = g8.DelayedScaling(amax_history_len=4)
BF16 = torch.bfloat16


def _config(**kw):
    return gl.register(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj"], **kw))


def _lora_lm(device, fp8_weights: bool = False, seed: int = 0):
    """TinyLM (embedding -> TransformerLayer -> norm -> head) with LoRA on the block's qkv and
    proj; B is random (peft starts it at 0, which would hide the adapter's path)."""
    torch.manual_seed(seed)
    if fp8_weights:
        with g8.fp8_model_init(recipe=RECIPE):
            model = TinyLM(device)
    else:
        model = TinyLM(device)
    model = peft.get_peft_model(model, _config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("fp8_weights", [False, True])
def test_adapters_train_over_a_frozen_fp8_base(device, fp8_weights):
    model = _lora_lm(device, fp8_weights)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    block = model.base_model.model.block
    assert isinstance(block.qkv, gl.LoraLayerNormLinear) and isinstance(block.proj, gl.LoraLinear)
    assert isinstance(block.qkv.base_layer.weight, g8.Float8Tensor) == fp8_weights
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    tokens, targets = lm_batch(1, device)
    losses = []
    for _ in range(6):
        with g8.fp8_autocast(recipe=RECIPE):
            loss = lm_loss(model(tokens[0], is_first_microbatch=True), targets[0])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0]
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert block.qkv.base_layer.fp8_meta is not None  # the base ran in FP8


def test_adapter_path_is_base_plus_low_rank_update(device):
    """In FP8: the LoRA layer's output and input gradient equal the base layer's plus
    B(A(x')) * scaling, x' the norm's output for LayerNormLinear, bit for bit."""
    for kind in ("LayerNormLinear", "Linear"):
        torch.manual_seed(0)
        base = getattr(g8, kind)(32, 48, params_dtype=BF16, device=device)
        twin = copy.deepcopy(base)
        lora = gl.LoraLayerNormLinear if kind == "LayerNormLinear" else gl.LoraLinear
        layer = lora(base, "default", config=_config(), r=4, lora_alpha=8)
        torch.nn.init.normal_(layer.lora_B["default"].weight, 0, 0.1)
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        x = torch.randn(16, 32, dtype=BF16, device=device, requires_grad=True)
        xt = x.detach().clone().requires_grad_()
        with g8.fp8_autocast(recipe=RECIPE):
            y = layer(x, is_first_microbatch=True)
            if kind == "LayerNormLinear":
                twin.return_layernorm_output = True
                yt, seen = twin(xt, is_first_microbatch=True)
            else:
                yt, seen = twin(xt, is_first_microbatch=True), xt
        want = yt + F.linear(F.linear(seen, a), b) * 2.0
        assert_bitwise_equal(y, want, kind)
        y.float().square().sum().backward()
        want.float().square().sum().backward()
        assert_bitwise_equal(x.grad, xt.grad, f"{kind}: input gradient")


def _train_graphed(device, mode: str):
    """3 steps x 2 microbatches of LoRA training, eager and through `mode` (per-layer graphs of
    the block, or the whole step as one graph), from the same seed: compared after each."""
    n = 2
    eager, graphed = _lora_lm(device), _lora_lm(device)
    batches = [lm_batch(n, device, seed=s) for s in range(3)]
    opt_e = adamw([p for p in eager.parameters() if p.requires_grad], device)
    opt_g = adamw([p for p in graphed.parameters() if p.requires_grad], device)
    if mode == "step":
        step = g8.make_graphed_step(graphed, lm_loss, opt_g, batches[0], n, fp8_enabled=True,
                                    fp8_recipe=RECIPE)  # fmt: skip
        for s, batch in enumerate(batches):
            step(batch)
            compare_step(step, eager_step(eager, lm_loss, opt_e, batch, n), f"step {s}")
    else:
        inner = graphed.base_model.model
        sample = torch.randn(2, 16, 32, dtype=BF16, device=device)  # the frozen embedding's
        g8.make_graphed_callables(inner.block, (sample,), fp8_enabled=True, fp8_recipe=RECIPE,
                                  fp8_weight_caching=True)  # fmt: skip
        for batch in batches:
            for model, opt in ((eager, opt_e), (graphed, opt_g)):
                eager_step(model, lm_loss, opt, batch, n)
    for (name, pe), (_, pg) in zip(eager.named_parameters(), graphed.named_parameters(),
                                   strict=True):  # fmt: skip
        assert_bitwise_equal(pg, pe, name)
    return graphed


@pytest.mark.parametrize("mode", ["layers", "step"])
def test_graphed_equals_eager(device, mode):
    graphed = _train_graphed(device, mode)
    a = graphed.base_model.model.block.qkv.lora_A["default"].weight
    assert a.requires_grad  # the adapters trained; the base stayed frozen


def test_merge_equals_peft_merge_of_a_torch_linear():
    """merge(): W += scaling * B @ A in place, equal bit for bit to peft's merge of the same
    adapter on a torch.nn.Linear; the FP8 weight cache is invalidated; unmerge() restores."""
    torch.manual_seed(0)
    layer = gl.LoraLayerNormLinear(g8.LayerNormLinear(32, 48, params_dtype=BF16), "default",
                                   config=_config(), r=4, lora_alpha=8)  # fmt: skip
    torch.nn.init.normal_(layer.lora_B["default"].weight, 0, 0.1)
    ref_linear = torch.nn.Linear(32, 48, dtype=BF16)
    ref_linear.weight.data.copy_(layer.base_layer.weight)
    ref = peft.tuners.lora.layer.Linear(ref_linear, "default", config=peft.LoraConfig(r=4),
                                        r=4, lora_alpha=8)  # fmt: skip
    ref.load_state_dict(layer.state_dict(), strict=False)
    original = layer.base_layer.weight.detach().clone()
    storage = layer.base_layer.weight.data_ptr()
    with g8.fp8_autocast(recipe=RECIPE):
        layer(torch.randn(16, 32, dtype=BF16), is_first_microbatch=True)
    layer.merge()
    ref.merge()
    assert_bitwise_equal(layer.base_layer.weight, ref.base_layer.weight, "merged weight")
    assert layer.base_layer.weight.data_ptr() == storage  # in place: graphs still see it
    # Issue 39: the message said "False before any True" after a True; now it names the merge.
    with pytest.raises(RuntimeError, match=r"stale \(a LoRA merge or unmerge changed them\)"):
        with g8.fp8_autocast(recipe=RECIPE):
            layer(torch.randn(16, 32, dtype=BF16), is_first_microbatch=False)
    x = torch.randn(16, 32, dtype=BF16)
    merged = layer(x)  # the base alone, with the merged weight
    layer.unmerge()
    assert torch.allclose(layer(x).float(), merged.float(), atol=3e-2)
    assert torch.allclose(layer.base_layer.weight.float(), original.float(), atol=1e-2)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: peft.get_peft_model(TinyLM(), gl.register(peft.LoraConfig(
            r=4, target_modules=["mlp"]))), "LayerNormMLP cannot take a LoRA adapter"),
        (lambda: peft.get_peft_model(TinyLM(), _config(use_dora=True)), "use_dora=True"),
        (lambda: _lora_lm("cpu", fp8_weights=True).merge_and_unload(), "merging into an FP8"),
    ],
)  # fmt: skip
def test_unsupported(make, match):
    with pytest.raises(NotImplementedError, match=match):
        make()
