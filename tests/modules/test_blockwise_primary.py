"""Blockwise FP8 primary weights (fp8_model_init(recipe=Float8BlockScaling())): weights stored in
128x128 blocks (Float8BlockTensor) quantized from their init, training through MasterWeights
equal to blockwise scaling with high-precision weights bit for bit, checkpoints, and clear
errors under another recipe."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.ops import blockwise as bw
from graphfp8.testing import assert_bitwise_equal

BLOCK = g8.Float8BlockScaling()
K, N, T = 288, 160, 64  # partial 128-blocks along both dims


@pytest.fixture(autouse=True)
def _cuda_gemm_path(monkeypatch):
    """CUDA runs the emulated GEMM unless GRAPHFP8_BLOCKWISE_GEMM chose a path."""
    if not bw.GEMM_MODE:
        monkeypatch.setattr(bw, "GEMM_MODE", "emulate")


def _build(kind: str, dtype, device, recipe=BLOCK, seed: int = 7):
    torch.manual_seed(seed)
    kw = dict(params_dtype=dtype, device=device)
    with g8.fp8_model_init(enabled=recipe is not None, recipe=recipe):
        if kind == "Linear":
            return g8.Linear(K, N, **kw)
        if kind == "SwiGLUMLP":
            return g8.LayerNormMLP(K, N, normalization="RMSNorm", bias=False,
                                   activation="swiglu", **kw)  # fmt: skip
        return g8.LayerNormMLP(K, N, **kw)


def _blocks(m) -> list[tuple[str, Float8BlockTensor]]:
    return [(n, p) for n, p in m.named_parameters() if isinstance(p, Float8BlockTensor)]


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("p2", [True, False])
def test_weights_are_their_init_quantized_in_blocks(device, p2):
    hp = _build("LayerNormMLP", torch.bfloat16, device, recipe=None)
    f8 = _build("LayerNormMLP", torch.bfloat16, device, g8.Float8BlockScaling(power_2_scale=p2))
    weights = _blocks(f8)
    assert [n for n, _ in weights] == ["fc1_weight", "fc2_weight"]
    for name, p in weights:
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.dtype == torch.bfloat16
        want_data, want_inv = bw.quantize_blocks(hp.get_parameter(name).detach(),
                                                 power_2_scale=p2)  # fmt: skip
        assert_bitwise_equal(_u8(p._data), _u8(want_data), f"{name} data")
        assert_bitwise_equal(p._scale_inv, want_inv, f"{name} scale_inv")
        assert p._scale_inv.shape == (-(-p.shape[0] // 128), -(-p.shape[1] // 128))
        assert_bitwise_equal(p.dequantize(torch.float32), bw.dequantize_blocks(want_data, want_inv))


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "SwiGLUMLP"])
def test_training_equals_blockwise_with_high_precision_weights(device, kind):
    """float32 parameters: the high-precision model's forward quantizes its weight into the
    blocks MasterWeights stored from the same fp32 master, so 3 steps x 2 microbatches of AdamW
    give the same outputs, input grads and masters bit for bit."""
    f8 = _build(kind, torch.float32, device)
    masters = g8.MasterWeights(f8)
    hp = copy.deepcopy(f8)
    for name, p in _blocks(f8):
        mod_name, _, attr = name.rpartition(".")
        setattr(hp.get_submodule(mod_name), attr, torch.nn.Parameter(p.dequantize(torch.float32)))
    opt_hp = torch.optim.AdamW(hp.parameters(), lr=1e-2, foreach=False)
    opt_f8 = torch.optim.AdamW(masters.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        for mb in range(2):
            x = torch.randn(T, K, device=device) * 10.0 ** (mb - 1)
            xs = [x.clone().requires_grad_() for _ in range(2)]
            ys = []
            for m, xi in zip((hp, f8), xs, strict=True):
                with g8.fp8_autocast(recipe=BLOCK):
                    ys.append(m(xi, is_first_microbatch=mb == 0))
                ys[-1].square().sum().backward()
            assert_bitwise_equal(ys[1], ys[0], f"step {step} mb {mb}: output")
            assert_bitwise_equal(xs[1].grad, xs[0].grad, f"step {step} mb {mb}: dgrad")
        opt_hp.step()
        masters.step(opt_f8)
        opt_hp.zero_grad()
        masters.zero_grad()
        for (name, p), m in zip(_blocks(f8), masters.masters, strict=True):
            assert_bitwise_equal(m, hp.get_parameter(name), f"step {step}: master {name}")
            want = bw.quantize_blocks(m.detach())  # the stored blocks are the master's
            assert_bitwise_equal(_u8(p._data), _u8(want[0]), f"step {step}: {name} data")
            assert_bitwise_equal(p._scale_inv, want[1], f"step {step}: {name} scale_inv")


def test_checkpoints_blocks_to_blocks_bit_for_bit_and_through_high_precision(device):
    f8 = _build("LayerNormMLP", torch.bfloat16, device)
    buf = io.BytesIO()
    torch.save(f8.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)  # weights_only=True: Float8BlockTensor is a safe global
    other = _build("LayerNormMLP", torch.bfloat16, device, seed=8)
    other.load_state_dict(state)
    for (name, p), (_, q) in zip(_blocks(f8), _blocks(other), strict=True):
        assert_bitwise_equal(_u8(q._data), _u8(p._data), f"{name} data")
        assert_bitwise_equal(q._scale_inv, p._scale_inv, f"{name} scale_inv")
    hp = _build("LayerNormMLP", torch.bfloat16, device, recipe=None)
    hp.load_state_dict(f8.state_dict())  # dequantized
    back = _build("LayerNormMLP", torch.bfloat16, device, seed=9)
    back.load_state_dict(hp.state_dict())  # quantized again per block: the same FP8 blocks
    for (name, p), (_, q) in zip(_blocks(f8), _blocks(back), strict=True):
        assert_bitwise_equal(hp.get_parameter(name), p.dequantize(), f"{name} dequantized")
        assert_bitwise_equal(_u8(q._data), _u8(p._data), f"{name} data after hp")
        assert_bitwise_equal(q._scale_inv, p._scale_inv, f"{name} scale_inv after hp")
    masters = g8.MasterWeights(f8)
    again = g8.MasterWeights(other)
    again.load_state_dict(masters.state_dict())
    for (name, p), (_, q) in zip(_blocks(f8), _blocks(other), strict=True):
        assert_bitwise_equal(_u8(q._data), _u8(p._data), f"{name} data from masters")


def test_deepcopy_and_snapshot_copy_keep_the_blocks(device):
    f8 = _build("Linear", torch.bfloat16, device)
    clone = copy.deepcopy(f8)
    assert isinstance(clone.weight, Float8BlockTensor) and clone.weight._data is not f8.weight._data
    assert_bitwise_equal(_u8(clone.weight._data), _u8(f8.weight._data))
    with torch.no_grad():
        clone.weight._scale_inv.fill_(3.0)
        clone.weight.copy_(f8.weight)  # what a capture's snapshot restore does
    assert_bitwise_equal(clone.weight._scale_inv, f8.weight._scale_inv)


def test_misuse_raises_clear_errors(device):
    f8 = _build("Linear", torch.bfloat16, device)
    x = torch.randn(T, K, dtype=torch.bfloat16, device=device)
    for recipe in (g8.DelayedScaling(), g8.Float8CurrentScaling()):
        with g8.fp8_autocast(recipe=recipe), pytest.raises(RuntimeError, match="blockwise FP8"):
            f8(x)
    with pytest.raises(RuntimeError, match="FP8 primary weights.*fp8_autocast"):
        f8(x)
    p2_off = g8.Float8BlockScaling(power_2_scale=False)
    with g8.fp8_autocast(recipe=p2_off), pytest.raises(RuntimeError, match="power_2_scale"):
        f8(x)
    per_tensor = _build("Linear", torch.bfloat16, device, recipe=g8.DelayedScaling())
    assert isinstance(per_tensor.weight, Float8Tensor)
    assert not isinstance(per_tensor.weight, Float8BlockTensor)
    with g8.fp8_autocast(recipe=BLOCK), pytest.raises(RuntimeError, match="per tensor"):
        per_tensor(x)
    with pytest.raises(RuntimeError, match="per-tensor FP8 weight has one scale"):
        per_tensor.load_state_dict(f8.state_dict())
    with pytest.raises(NotImplementedError, match="MasterWeights"):
        with torch.no_grad():
            f8.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="keeps no transpose"):
        f8.weight.transpose_fp8()
    with pytest.raises(NotImplementedError, match="fully_shard"):
        torch.chunk(f8.weight, 2)  # what FSDP2 does: its shards would be high precision


@pytest.mark.parametrize("recipe", [BLOCK, g8.DelayedScaling()], ids=["blockwise", "per_tensor"])
def test_a_checkpoint_loaded_after_building_the_masters_is_trained(device, recipe):
    """Issue 42: model.load_state_dict(high-precision checkpoint) after MasterWeights(model)
    was silently undone by the next step's write-back of the old masters. Now the masters adopt
    the loaded weights (dequantized, as construction seeds them; the sharded masters did
    already), so a step with lr 0 keeps the loaded blocks; a weight rewritten with its own
    bytes (a capture's restore) keeps its master bit for bit."""
    f8 = _build("Linear", torch.bfloat16, device, recipe)
    masters = g8.MasterWeights(f8)
    before = masters.masters[0].detach().clone()
    with torch.no_grad():
        f8.weight.copy_(copy.deepcopy(f8.weight))  # the same bytes: nothing adopted
    opt = torch.optim.SGD(masters.parameters(), lr=0.0)
    masters.step(opt)
    assert_bitwise_equal(masters.masters[0], before)
    pretrained = _build("Linear", torch.bfloat16, device, recipe=None, seed=11)
    f8.load_state_dict(pretrained.state_dict())
    loaded = (_u8(f8.weight._data).clone(), f8.weight._scale_inv.clone())
    x = torch.randn(T, K, dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=BLOCK if recipe is BLOCK else g8.Float8CurrentScaling()):
        f8(x).sum().backward()
    masters.step(opt)
    assert_bitwise_equal(masters.masters[0], f8.weight.dequantize(torch.float32))
    assert_bitwise_equal(_u8(f8.weight._data), loaded[0], "data after the step")
    assert_bitwise_equal(f8.weight._scale_inv, loaded[1], "scale_inv after the step")


def _with_a_224_block(device) -> g8.Linear:
    """A blockwise Linear whose block (0, 0) has its amax at 227.8 / 128: E4M3 rounds it to 224
    under the power-of-2 scale 128, so its dequantized values quantized again take the scale
    256 (other bytes)."""
    f8 = _build("Linear", torch.bfloat16, device)
    hp = f8.weight.dequantize()
    hp[0, 0] = 227.8 / 128
    f8.load_state_dict({"weight": hp, "bias": f8.bias.detach()})
    assert f8.weight._scale_inv[0, 0] == 2.0**-7
    return f8


def test_a_state_dict_moved_between_devices_keeps_the_blocks(device):
    """Issue 42: .to(device) of a blockwise FP8 weight (a state dict moved to the CPU, with
    copy=True on the same device) gave its dequantized values, which a load quantized again: the
    224 block came back with other bytes. A move now keeps data and scales; a dtype change
    still gives the high-precision values."""
    f8 = _with_a_224_block(device)
    moved = {k: v.to("cpu", copy=True) for k, v in f8.state_dict().items()}
    assert isinstance(moved["weight"], Float8BlockTensor)
    assert moved["weight"]._data.data_ptr() != f8.weight._data.data_ptr()
    other = _build("Linear", torch.bfloat16, device, seed=3)
    other.load_state_dict({k: v.to(device) for k, v in moved.items()})
    assert_bitwise_equal(_u8(other.weight._data), _u8(f8.weight._data))
    assert_bitwise_equal(other.weight._scale_inv, f8.weight._scale_inv)
    hp = f8.weight.to(torch.float32)
    assert type(hp) is torch.Tensor
    assert_bitwise_equal(hp, f8.weight.dequantize(torch.float32))


@pytest.mark.cuda
def test_a_blockwise_weight_moves_between_cpu_and_cuda():
    f8 = _with_a_224_block("cuda")
    on_cpu = f8.weight.cpu()
    assert isinstance(on_cpu, Float8BlockTensor) and on_cpu._data.device.type == "cpu"
    back = on_cpu.cuda()
    assert_bitwise_equal(_u8(back._data), _u8(f8.weight._data))
    assert_bitwise_equal(back._scale_inv, f8.weight._scale_inv)
