"""The blockwise weight cache (fp8/weight_cache.py's BlockWorkspace, modules/_context.py's
blockwise_weights): under Float8BlockScaling a weight's 128x128 blocks and their transpose are
quantized once per step (is_first_microbatch True) and reused by microbatches 2..n, bit for bit
what requantizing gives; a weight changed between steps is quantized anew; the graphs' flag and
the step graph's per-microbatch casts follow the same rule (graphed == eager)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import graphfp8 as g8
from graphfp8.memory import memory_report
from graphfp8.ops import blockwise as bw
from graphfp8.ops.blockwise_fused import blockwise_kernels
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import train_pair
from tests.modules.common import H, Stack, T, build

BLOCK = g8.Float8BlockScaling()


@pytest.fixture(autouse=True)
def _cuda_gemm_path(monkeypatch):
    """On CUDA the emulated GEMM unless GRAPHFP8_BLOCKWISE_GEMM chose a path."""
    if not bw.GEMM_MODE:
        monkeypatch.setattr(bw, "GEMM_MODE", "emulate")


class _Quantizations(TorchDispatchMode):
    """Counts the blockwise quantizations of 128x128 blocks (the fused op with block_rows 128)."""

    def __init__(self):
        super().__init__()
        self.blocks = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.graphfp8.blockwise_quantize.default:
            rows = kwargs.get("block_rows", args[5] if len(args) > 5 else 1)
            self.blocks += rows == 128
        return func(*args, **kwargs)


def _microbatches(model, recipe, xs, firsts, dys):
    """Forward and backward of each microbatch; returns the outputs."""
    outs = []
    for x, first, dy in zip(xs, firsts, dys, strict=True):
        with g8.fp8_autocast(recipe=recipe):
            y = model(x, is_first_microbatch=first)
        y.backward(dy)
        outs.append(y.detach())
    return outs


@pytest.mark.parametrize("kernels", ["fused", "torch"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "Stack"])
def test_cached_microbatches_equal_requantizing(device, kind, kernels):
    """Two steps of three microbatches: is_first_microbatch (True, False, False) against None
    each time (every call quantizes): outputs, input and weight gradients and the updated
    weights equal bit for bit, so step 2's True saw the weights step 1's optimizer wrote."""
    cached = build(kind, device=device) if kind != "Stack" else Stack(device=device)
    fresh = copy.deepcopy(cached)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (cached, fresh)]
    gen = torch.Generator().manual_seed(0)
    with blockwise_kernels(kernels):
        for step in range(2):
            xs = [torch.randn(T, H, generator=gen).bfloat16().to(device) for _ in range(3)]
            xs = [x.requires_grad_() for x in xs]
            x2 = [x.detach().clone().requires_grad_() for x in xs]
            y = cached(xs[0].detach())
            dys = [torch.randn(y.shape, generator=gen).bfloat16().to(device) for _ in range(3)]
            out_c = _microbatches(cached, BLOCK, xs, [True, False, False], dys)
            out_f = _microbatches(fresh, BLOCK, x2, [None] * 3, dys)
            for i in range(3):
                assert_bitwise_equal(out_c[i], out_f[i], f"step {step} mb {i}: output")
                assert_bitwise_equal(xs[i].grad, x2[i].grad, f"step {step} mb {i}: dgrad")
            for (name, pc), (_, pf) in zip(
                cached.named_parameters(), fresh.named_parameters(), strict=True
            ):
                assert_bitwise_equal(pc.grad, pf.grad, f"step {step}: grad {name}")
            for opt in opts:
                opt.step()
                opt.zero_grad()


def test_without_cached_transposes(device):
    """cache_weight_transposes(model, False): the cache keeps the blocks only (1 byte a weight
    element) and each backward transposes them; the same bits as with the transposes cached."""
    kept = Stack(device=device)
    bare = copy.deepcopy(kept)
    g8.modules.cache_weight_transposes(bare, False)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen).bfloat16().to(device).requires_grad_() for _ in range(2)]
    x2 = [x.detach().clone().requires_grad_() for x in xs]
    dys = [torch.randn(T, H, generator=gen).bfloat16().to(device) for _ in range(2)]
    out_k = _microbatches(kept, BLOCK, xs, [True, False], dys)
    out_b = _microbatches(bare, BLOCK, x2, [True, False], dys)
    for i in range(2):
        assert_bitwise_equal(out_b[i], out_k[i], f"mb {i}: output")
        assert_bitwise_equal(x2[i].grad, xs[i].grad, f"mb {i}: dgrad")
    for (name, pk), (_, pb) in zip(kept.named_parameters(), bare.named_parameters(), strict=True):
        assert_bitwise_equal(pb.grad, pk.grad, f"grad {name}")
    ws = bare.proj.weight_cache.workspaces["weight:blocks"]
    assert ws._transpose is None and ws._data.shape == bare.proj.weight.shape


def test_microbatches_after_the_first_reuse_the_blocks(device):
    """A False call quantizes no weight (one block quantization per weight on True, none on
    False) and reads the blocks the True call wrote: a weight changed in place in between is
    not seen until the next True. The fused kernel on every device: the counter sees its op
    (CUDA's default is the torch ops until the kernel's H200 run lands the switch)."""
    layer = g8.LayerNormMLP(H, 2 * H, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    with blockwise_kernels("fused"), g8.fp8_autocast(recipe=BLOCK):
        with _Quantizations() as first:
            y0 = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.fc1_weight.mul_(2)
        with _Quantizations() as reuse:
            y1 = layer(x, is_first_microbatch=False)
        y2 = layer(x, is_first_microbatch=True)
        y3 = layer(x)
    assert (first.blocks, reuse.blocks) == (2, 0)
    assert_bitwise_equal(y1, y0, "False reuses the cached blocks")
    assert not torch.equal(y2, y0)
    assert_bitwise_equal(y3, y2, "True quantized the current weights")


def test_false_without_cached_blocks_raises():
    """False before any True raises before anything runs, as under per-tensor scaling; so does
    False after a load_state_dict rewrote the weights."""
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=BLOCK):
        with pytest.raises(RuntimeError, match="before any is_first_microbatch=True"):
            layer(x, is_first_microbatch=False)
        layer(x, is_first_microbatch=True)
        layer.load_state_dict(copy.deepcopy(layer.state_dict()))
        with pytest.raises(RuntimeError, match="stale .load_state_dict wrote the weights"):
            layer(x, is_first_microbatch=False)


def test_false_after_casts_under_the_other_recipe_raises():
    """The cache holds one recipe's casts at a time: blockwise blocks cached, then per-tensor
    casts of changed weights, then a blockwise False would read blocks of the old weights: it
    raises instead (it returned the stale result before), and so does the other way round."""
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    delayed = g8.DelayedScaling()
    with g8.fp8_autocast(recipe=BLOCK):
        layer(x, is_first_microbatch=True)
    with torch.no_grad():
        layer.weight.mul_(2)
    with g8.fp8_autocast(recipe=delayed):
        layer(x, is_first_microbatch=True)
    with g8.fp8_autocast(recipe=BLOCK):
        with pytest.raises(RuntimeError, match="last cast under per-tensor scaling"):
            layer(x, is_first_microbatch=False)
        layer(x, is_first_microbatch=True)
    with g8.fp8_autocast(recipe=delayed):
        with pytest.raises(RuntimeError, match="last cast under blockwise scaling"):
            layer(x, is_first_microbatch=False)


def test_an_evaluation_call_leaves_the_cache_alone():
    """eval() with None quantizes the current weights afresh and writes no cached block: a
    training False afterwards still reads what the last True cached."""
    layer = g8.Linear(H, H, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=BLOCK):
        y0 = layer(x, is_first_microbatch=True)
        with torch.no_grad():
            layer.weight.mul_(-1)
        layer.eval()
        y_eval = layer(x)
        layer.train()
        y1 = layer(x, is_first_microbatch=False)
    assert_bitwise_equal(y_eval, -y0, "eval: the current weights")
    assert_bitwise_equal(y1, y0, "the cache as training left it")


def test_the_cache_is_in_the_memory_report():
    """The cached blocks and their transpose count as the FP8 weight cache (2 bytes a weight
    element, the scales beside)."""
    layer = g8.Linear(256, 128, params_dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=BLOCK):
        layer(torch.randn(16, 256, dtype=torch.bfloat16), is_first_microbatch=True)
    report = memory_report(layer)
    assert report.bytes["FP8 weights"] >= 2 * 256 * 128


@pytest.mark.parametrize("kind", ["Linear", "SwiGLUMLP"])
def test_graphed_with_caching_equals_eager_and_requantizing(device, kind):
    """make_graphed_callables(fp8_weight_caching=True): the graphs' flag skips the cached
    microbatches' weight quantization on the device; graphed == eager (both cached) bit for
    bit, and both equal a run that requantizes every call."""
    model = build(kind, device=device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    torch.manual_seed(0)
    eager, _, _ = train_pair(copy.deepcopy(model), sample, BLOCK, True, steps=2, mbs=2)
    torch.manual_seed(0)  # the same data
    fresh, _, _ = train_pair(copy.deepcopy(model), sample, BLOCK, False, steps=2, mbs=2)
    for (name, pe), (_, pf) in zip(eager.named_parameters(), fresh.named_parameters(), strict=True):
        assert_bitwise_equal(pe, pf, f"cached vs requantized: {name}")
