"""FP8 primary weights (fp8_model_init) and MasterWeights, eagerly: the weight is an FP8 parameter
holding its init quantized, memory, training equals a high-precision model bit for bit (current
scaling, fp32 masters), checkpoints, and clear errors for misuse."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import graphfp8 as g8
from graphfp8 import reference
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.memory import memory_report
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, T

CURRENT = g8.Float8CurrentScaling()


def _pair(kind: str, dtype, device):
    """(high-precision module, the same module created inside fp8_model_init), same seed."""
    cls = {"Linear": g8.Linear, "LayerNormLinear": g8.LayerNormLinear}.get(kind, g8.LayerNormMLP)
    torch.manual_seed(7)
    hp = cls(H, 2 * H, params_dtype=dtype, device=device)
    torch.manual_seed(7)
    with g8.fp8_model_init():
        f8 = cls(H, 2 * H, params_dtype=dtype, device=device)
    return hp, f8


def _fp8_weights(m) -> list[tuple[str, Float8Tensor]]:
    return [(n, p) for n, p in m.named_parameters() if isinstance(p, Float8Tensor)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_weights_are_fp8_parameters_quantized_from_their_init(device, kind):
    hp, f8 = _pair(kind, torch.bfloat16, device)
    weights = _fp8_weights(f8)
    assert len(weights) == (2 if kind == "LayerNormMLP" else 1)
    hp_params = dict(hp.named_parameters())
    for name, p in f8.named_parameters():
        if not isinstance(p, Float8Tensor):
            assert_bitwise_equal(p, hp_params[name], name)  # biases and norms: unchanged
            continue
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert p.dtype == torch.bfloat16 and p.fp8_dtype == torch.float8_e4m3fn
        w = hp_params[name].detach()
        scale = reference.current_scale(w, torch.ones(1, device=device),
                                        torch.tensor([448.0], device=device))  # fmt: skip
        assert_bitwise_equal(_bytes(p._data), _bytes(reference.quantize(w, scale, p.fp8_dtype)))
        assert_bitwise_equal(p._scale_inv, torch.reciprocal(scale), f"{name} scale_inv")


def test_weight_memory_halves_against_bf16(device):
    """graphfp8.memory's report: a bf16 weight plus its FP8 workspace (data and transpose) is 4
    bytes per element, an FP8 primary weight (data and transpose cache) 2; nothing else moves."""
    reports = {}
    for name, m in zip(("hp", "fp8"), _pair("LayerNormMLP", torch.bfloat16, device), strict=True):
        x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
        with g8.fp8_autocast(recipe=CURRENT):
            y = m(x, is_first_microbatch=True)
        reports[name] = memory_report(m, outputs=y).bytes
    hp, f8 = reports["hp"], reports["fp8"]
    gemm_weights = 2 * (H * 2 * H)  # fc1 and fc2 elements
    assert (
        hp["parameters"] + hp["FP8 weights"] - gemm_weights * 4
        == f8["parameters"] - gemm_weights * 2
    )
    assert "FP8 weights" not in f8 or f8["FP8 weights"] == 0  # no separate workspace
    assert hp["saved activations"] == f8["saved activations"]


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_training_equals_high_precision_model_bit_for_bit(device, kind):
    """float32 parameters, Float8CurrentScaling: the high-precision model casts its weight with
    the scale of its own amax, exactly as MasterWeights quantizes the fp32 master, so training
    (3 steps x 3 microbatches, AdamW) gives the same outputs, grads and masters bit for bit."""
    _, f8 = _pair(kind, torch.float32, device)
    masters = g8.MasterWeights(f8)
    hp = copy.deepcopy(f8)
    for name, p in _fp8_weights(f8):
        mod_name, _, attr = name.rpartition(".")
        mod = hp.get_submodule(mod_name)
        setattr(mod, attr, torch.nn.Parameter(p.dequantize(torch.float32)))
    for (name, _), m in zip(_fp8_weights(f8), masters.masters, strict=True):
        assert_bitwise_equal(m, hp.get_parameter(name), f"master {name}")
    # One AdamW implementation for both: torch steps the masters (a tensor subclass) with its
    # for-loop one by default, plain CUDA tensors with foreach (1-ulp apart: H200 2026-12-01).
    opt_hp = torch.optim.AdamW(hp.parameters(), lr=1e-2, foreach=False)
    opt_f8 = torch.optim.AdamW(masters.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        for mb in range(3):
            x = torch.randn(T, H, device=device) * 10.0 ** (mb - 1)
            xs = [x.clone().requires_grad_() for _ in range(2)]
            ys = []
            for m, xi in zip((hp, f8), xs, strict=True):
                with g8.fp8_autocast(recipe=CURRENT):
                    ys.append(m(xi, is_first_microbatch=mb == 0))
                ys[-1].square().sum().backward()
            assert_bitwise_equal(ys[1], ys[0], f"step {step} mb {mb}: output")
            assert_bitwise_equal(xs[1].grad, xs[0].grad, f"step {step} mb {mb}: dgrad")
        opt_hp.step()
        masters.step(opt_f8)
        opt_hp.zero_grad()
        masters.zero_grad()
        for (name, p), m in zip(_fp8_weights(f8), masters.masters, strict=True):
            assert_bitwise_equal(m, hp.get_parameter(name), f"step {step}: master {name}")
            assert not p._transpose_valid  # rewritten: the next forward rebuilds the transpose


def test_eager_transpose_is_rebuilt_after_the_weights_change(device):
    """is_first_microbatch=False reuses the transpose cache, except after a write-back."""
    _, f8 = _pair("Linear", torch.bfloat16, device)
    masters = g8.MasterWeights(f8)
    opt = torch.optim.SGD(masters.parameters(), lr=0.5)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with g8.fp8_autocast(recipe=CURRENT):
        f8(x, is_first_microbatch=True).sum().backward()
    masters.step(opt)
    w = f8.weight
    assert not w._transpose_valid
    with g8.fp8_autocast(recipe=CURRENT):
        f8(x, is_first_microbatch=False)
    assert w._transpose_valid
    assert_bitwise_equal(_bytes(w._transpose), _bytes(w._data.t().contiguous()), "transpose")


def test_checkpoints_fp8_to_fp8_bit_for_bit_and_to_high_precision_and_back(device):
    _, f8 = _pair("LayerNormMLP", torch.bfloat16, device)
    buf = io.BytesIO()
    torch.save(f8.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)  # weights_only=True: Float8Tensor is a safe global
    _, other = _pair("LayerNormMLP", torch.bfloat16, device)
    for _, p in _fp8_weights(other):
        p._data.view(torch.uint8).fill_(0)
    other.load_state_dict(state)
    for (name, p), (_, q) in zip(_fp8_weights(f8), _fp8_weights(other), strict=True):
        assert_bitwise_equal(_bytes(q._data), _bytes(p._data), f"{name} data")
        assert_bitwise_equal(q._scale_inv, p._scale_inv, f"{name} scale_inv")
        assert not q._transpose_valid
    hp, _ = _pair("LayerNormMLP", torch.bfloat16, device)
    hp.load_state_dict(f8.state_dict())
    for name, p in _fp8_weights(f8):
        assert_bitwise_equal(hp.get_parameter(name), p.dequantize(), f"{name} dequantized")
    back = _pair("LayerNormMLP", torch.bfloat16, device)[1]
    back.load_state_dict(hp.state_dict())  # quantized again: the same FP8 values
    for (name, p), (_, q) in zip(_fp8_weights(f8), _fp8_weights(back), strict=True):
        assert_bitwise_equal(_bytes(q._data), _bytes(p._data), f"{name} data after hp")
        torch.testing.assert_close(q._scale_inv, p._scale_inv, rtol=1e-2, atol=0)


def test_master_weights_state_dict_round_trip(device):
    _, f8 = _pair("Linear", torch.bfloat16, device)
    masters = g8.MasterWeights(f8)
    opt = torch.optim.SGD(masters.parameters(), lr=0.1)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=CURRENT):
        f8(x).sum().backward()
    masters.step(opt)
    state = masters.state_dict()
    _, f8b = _pair("Linear", torch.bfloat16, device)
    other = g8.MasterWeights(f8b)
    other.load_state_dict(state)
    assert_bitwise_equal(other.masters[0], masters.masters[0], "master")
    assert_bitwise_equal(_bytes(f8b.weight._data), _bytes(f8.weight._data), "FP8 weight")
    with pytest.raises(ValueError, match="masters for"):
        other.load_state_dict({"masters": {"nope": masters.masters[0]}})


def test_misuse_raises_clear_errors(device):
    _, f8 = _pair("Linear", torch.bfloat16, device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(RuntimeError, match="FP8 primary weights.*fp8_autocast"):
        f8(x)
    with pytest.raises(RuntimeError, match="FP8 primary weights.*fp8_autocast"):
        with g8.fp8_autocast(enabled=False):
            f8(x)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with g8.fp8_model_init(enabled=1):
            pass
    with pytest.raises(TypeError, match="fp8_model_init: recipe must be"):
        with g8.fp8_model_init(recipe="current"):
            pass
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        with g8.fp8_model_init():
            g8.Linear(H, H, params_dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="no FP8 primary weights"):
        g8.MasterWeights(g8.Linear(H, H, device=device))
    opt = torch.optim.SGD(f8.parameters(), lr=0.1)  # a plain optimizer on the FP8 weight
    with g8.fp8_autocast(recipe=CURRENT):
        f8(x).sum().backward()
    with pytest.raises(NotImplementedError, match="MasterWeights"):
        opt.step()
    for move in (lambda m: m.to(torch.float32), lambda m: m.half()):
        with pytest.raises(RuntimeError, match="cannot be moved or cast"):
            move(f8)
    assert isinstance(f8.to(device).weight, Float8Tensor)  # no change: allowed
    with g8.fp8_model_init(enabled=False):
        assert not isinstance(g8.Linear(H, H, device=device).weight, Float8Tensor)
    with pytest.raises(RuntimeError, match="convert keeps the model's own"):
        with g8.fp8_model_init():
            g8.convert(torch.nn.Sequential(torch.nn.Linear(H, H, device=device)))
