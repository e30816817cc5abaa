"""fuse_wgrad_accumulation (TransformerEngine's option) on Linear, LayerNormLinear, LayerNormMLP
and TransformerLayer: the weight-gradient GEMM adds into each weight's fp32 main_grad, the weight
gets no .grad, everything else is what the unfused layer gives; the checks of main_grad before
any state changes."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
import graphfp8.te as te
from graphfp8.modules.base import FP8Module
from graphfp8.ops.switches import kernel_switch
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import DEVICES
from tests.modules.common import build, fp8_state, input_shape

KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "SwiGLUMLP", "TransformerLayer"]
GEMM_WEIGHTS = ("weight", "fc1_weight", "fc2_weight")
RECIPE = g8.DelayedScaling(amax_history_len=4)


def gemm_weights(model) -> list[torch.nn.Parameter]:
    """The GEMM weights of model's graphfp8 layers."""
    out = []
    for mod in model.modules():
        if isinstance(mod, FP8Module):
            out += [getattr(mod, n) for n in GEMM_WEIGHTS if hasattr(mod, n)]
    return out


def fuse(model, start: float | None = 0.0):
    """Turns the option on in every graphfp8 layer and gives each GEMM weight a main_grad filled
    with `start` (random where None)."""
    for mod in model.modules():
        if isinstance(mod, FP8Module):
            mod.fuse_wgrad_accumulation = True
    for w in gemm_weights(model):
        w.main_grad = (
            torch.randn(w.shape).to(w.device) if start is None
            else torch.full(w.shape, start, device=w.device)
        )  # fmt: skip
    return model


def _train(model, xs, fp8=True, recipe=RECIPE):
    for i, x in enumerate(xs):
        with g8.fp8_autocast(enabled=fp8, recipe=recipe):
            y = model(x, is_first_microbatch=i == 0)
        y.float().square().mean().backward()


def _inputs(model, n=2):
    torch.manual_seed(1)
    p = next(model.parameters())
    return [torch.randn(input_shape(model), dtype=p.dtype, device=p.device, requires_grad=True)
            for _ in range(n)]  # fmt: skip


def _assert_main_grads_are_grads(plain, fused, kind):
    """The fused model's GEMM weights: no .grad, main_grad bit for bit the plain model's .grad;
    every other parameter's .grad bit for bit the plain one's."""
    for (name, p), (_, f) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        if any(f is w for w in gemm_weights(fused)):
            assert f.grad is None, name
            assert_bitwise_equal(f.main_grad, p.grad, f"{kind}: main_grad of {name}")
        else:
            assert_bitwise_equal(f.grad, p.grad, f"{kind}: grad of {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_main_grad_holds_the_weight_gradients(kind, device):
    """fp32 parameters: the unfused wgrad GEMM's fp32 output summed by autograd against the
    fused GEMM's in-place sum (the same products; the CPU kernel sums in another order, cuBLASLt
    adds in its epilogue)."""
    torch.manual_seed(0)
    plain = build(kind, dtype=torch.float32, device=device)
    fused = fuse(copy.deepcopy(plain))
    xs_p, xs_f = _inputs(plain), _inputs(fused)
    _train(plain, xs_p)
    _train(fused, xs_f)
    for (name, p), (_, f) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        if any(f is w for w in gemm_weights(fused)):
            assert f.grad is None, name
            torch.testing.assert_close(f.main_grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert_bitwise_equal(f.grad, p.grad, f"{kind}: grad of {name}")
    for xp, xf in zip(xs_p, xs_f, strict=True):
        assert_bitwise_equal(xf.grad, xp.grad, f"{kind}: input grad")
    for (name, sp), (_, sf) in zip(fp8_state(plain), fp8_state(fused), strict=True):
        assert_bitwise_equal(sf, sp, f"{kind}: {name}")


def test_qkv_rope_path_accumulates_into_main_grad():
    """TransformerLayer's QKV projection fused with RoPE (kernel switch ROPE_CAST_BWD) adds its
    weight gradient into main_grad too."""
    torch.manual_seed(0)
    plain = build("LlamaLayer", dtype=torch.float32)
    fused = fuse(copy.deepcopy(plain))
    with kernel_switch("ROPE_CAST_BWD", True):
        _train(plain, _inputs(plain))
        _train(fused, _inputs(fused))
    assert fused.qkv.weight.grad is None
    torch.testing.assert_close(fused.qkv.weight.main_grad, plain.qkv.weight.grad, rtol=1e-5,
                               atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_adds_to_what_main_grad_holds(kind):
    """main_grad is accumulated into, not overwritten: from a random start, the start plus what
    the same training adds to zeros."""
    torch.manual_seed(0)
    a = fuse(build(kind), start=None)
    b = fuse(copy.deepcopy(a))
    starts = [w.main_grad.clone() for w in gemm_weights(a)]
    _train(a, _inputs(a))
    _train(b, _inputs(b))
    for wa, wb, s in zip(gemm_weights(a), gemm_weights(b), starts, strict=True):
        assert wb.main_grad.abs().sum() > 0
        torch.testing.assert_close(wa.main_grad, s + wb.main_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_high_precision_path_adds_the_autograd_gradient(kind):
    """Outside fp8_autocast the option still routes the gradient into main_grad (a separate add
    of the high-precision gradient): bit for bit the unfused .grad for fp32 parameters."""
    torch.manual_seed(0)
    plain = build(kind, dtype=torch.float32)
    fused = fuse(copy.deepcopy(plain))
    _train(plain, _inputs(plain), fp8=False)
    _train(fused, _inputs(fused), fp8=False)
    _assert_main_grads_are_grads(plain, fused, kind)


def test_grad_added_to_main_grad_is_set_where_the_weight_has_it():
    m = fuse(build("LayerNormMLP"))
    m.fc1_weight.grad_added_to_main_grad = False
    _train(m, _inputs(m, 1))
    assert m.fc1_weight.grad_added_to_main_grad is True
    assert not hasattr(m.fc2_weight, "grad_added_to_main_grad")


def test_transformer_layer_passes_the_option_down():
    layer = g8.TransformerLayer(32, 2, 64, max_seq_len=16, fuse_wgrad_accumulation=True)
    assert layer.qkv.fuse_wgrad_accumulation and layer.proj.fuse_wgrad_accumulation
    assert layer.mlp.fuse_wgrad_accumulation
    assert not g8.TransformerLayer(32, 2, 64, max_seq_len=16).mlp.fuse_wgrad_accumulation
    assert g8.Linear(32, 32, fuse_wgrad_accumulation=True).fuse_wgrad_accumulation


def test_no_grad_and_frozen_weights_need_no_main_grad():
    m = g8.Linear(32, 32, fuse_wgrad_accumulation=True)
    x = torch.randn(16, 32)
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
        m(x)
    m.weight.requires_grad_(False)
    with g8.fp8_autocast(recipe=RECIPE):
        m(x.requires_grad_()).sum().backward()
    assert m.weight.grad is None


@pytest.mark.parametrize(
    "main_grad, error, words",
    [
        (None, RuntimeError, "has no main_grad"),
        (lambda w: torch.zeros(w.shape, dtype=torch.bfloat16), TypeError, "must be float32"),
        (lambda w: torch.zeros(w.shape[1], w.shape[0]), ValueError, "has shape"),
        (lambda w: torch.zeros(w.shape, device="meta"), ValueError, "is on meta"),
        (lambda w: torch.zeros(w.shape).t().contiguous().t(), ValueError, "contiguous"),
        (lambda w: "grads", TypeError, "must be a torch.Tensor"),
        (lambda w: torch.zeros(w.numel() + 1)[1:].view(w.shape), ValueError, "16-byte aligned"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("fp8", [True, False])
def test_main_grad_errors_before_any_state_changes(main_grad, error, words, fp8):
    m = fuse(build("LayerNormMLP"))
    _train(m, _inputs(m, 1))  # FP8 state exists
    state = [(n, t.clone()) for n, t in fp8_state(m)]
    del m.fc2_weight.main_grad
    if main_grad is not None:
        m.fc2_weight.main_grad = main_grad(m.fc2_weight)
    with pytest.raises(error, match=words), g8.fp8_autocast(enabled=fp8, recipe=RECIPE):
        m(_inputs(m, 1)[0], is_first_microbatch=True)
    for (name, before), (_, after) in zip(state, fp8_state(m), strict=True):
        assert_bitwise_equal(after, before, name)


def test_te_drop_in_takes_the_option():
    """graphfp8.te's layers take TE's fuse_wgrad_accumulation (it used to be refused unless
    False) and hand it to graphfp8's."""
    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                attn_input_format="bshd", fuse_wgrad_accumulation=True)  # fmt: skip
    fused = [layer.self_attention.layernorm_qkv, layer.self_attention.proj, layer.layernorm_mlp]
    assert all(m.fuse_wgrad_accumulation for m in fused)
    lin = fuse(te.Linear(32, 32, fuse_wgrad_accumulation=True, params_dtype=torch.float32))
    with g8.fp8_autocast(recipe=RECIPE):
        lin(torch.randn(16, 32)).sum().backward()
    assert lin.weight.grad is None and lin.weight.main_grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_blockwise_fused_norm_routes_the_weight_gradient_into_main_grad(kind, monkeypatch):
    """Float8BlockScaling with the norm writing fc1's tiles (GRAPHFP8_BLOCKWISE_NORM): the weight
    the fused norm-GEMM takes adds its gradient into main_grad like every other blockwise GEMM
    (a separate add onto zeros: bit for bit the unfused .grad for fp32 parameters)."""
    from graphfp8.modules import _blockwise_norm

    _blockwise_main_grads(kind, [_blockwise_norm.FUSED], monkeypatch)


def _blockwise_main_grads(kind: str, switches, monkeypatch) -> None:
    """Float8BlockScaling training with the fused-kernel switches on: main_grad == plain .grad."""
    for switch in switches:
        monkeypatch.setattr(switch, "on", True)
    torch.manual_seed(0)
    plain = build(kind, dtype=torch.float32)
    fused = fuse(copy.deepcopy(plain))
    for model in (plain, fused):
        _train(model, _inputs(model), recipe=g8.Float8BlockScaling())
    _assert_main_grads_are_grads(plain, fused, kind)


@pytest.mark.parametrize("kind", ["LayerNormMLP", "SwiGLUMLP"])
def test_blockwise_fused_activation_routes_the_weight_gradient_into_main_grad(kind, monkeypatch):
    """Float8BlockScaling with the activation writing fc2's tiles (GRAPHFP8_BLOCKWISE_ACT, the
    norm's switch on too): fc2's gradient reaches main_grad as every blockwise GEMM's does."""
    from graphfp8.modules import _blockwise_act, _blockwise_norm

    _blockwise_main_grads(kind, [_blockwise_act.FUSED, _blockwise_norm.FUSED], monkeypatch)
