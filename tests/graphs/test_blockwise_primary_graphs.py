"""Blockwise FP8 primary weights inside the graphs: per-callable graphs with MasterWeights and the
whole step graph (master_weights=) equal the eager runs bit for bit, data and block scales
included; the stored blocks are read as they are (no weight quantization in the graph)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8.block_tensor import Float8BlockTensor
from graphfp8.ops import blockwise
from graphfp8.ops.blockwise_fused import blockwise_kernels
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import TinyLM, adamw, lm_batch, lm_loss
from tests.modules.common import H, Stack, T

BLOCK = g8.Float8BlockScaling()


@pytest.fixture(autouse=True)
def _cuda_gemm_path(monkeypatch):
    """CUDA runs the emulated GEMM unless GRAPHFP8_BLOCKWISE_GEMM chose a path."""
    if not blockwise.GEMM_MODE:
        monkeypatch.setattr(blockwise, "GEMM_MODE", "emulate")


def _build(kind: str, device):
    with g8.fp8_model_init(recipe=BLOCK):
        if kind == "Linear":
            return g8.Linear(H, 2 * H, params_dtype=torch.bfloat16, device=device)
        if kind == "LayerNormMLP":
            return g8.LayerNormMLP(H, 2 * H, params_dtype=torch.bfloat16, device=device)
        return Stack(device=device)


def _compare(eager, graphed, what: str) -> None:
    for (name, pe), (_, pg) in zip(eager.named_parameters(), graphed.named_parameters(),
                                   strict=True):  # fmt: skip
        if isinstance(pe, Float8BlockTensor):
            assert_bitwise_equal(pg._data.view(torch.uint8), pe._data.view(torch.uint8),
                                 f"{what}: {name} data")  # fmt: skip
            assert_bitwise_equal(pg._scale_inv, pe._scale_inv, f"{what}: {name} scale_inv")
        else:
            assert_bitwise_equal(pg, pe, f"{what}: {name}")
        if pe.grad is not None:
            assert_bitwise_equal(pg.grad, pe.grad, f"{what}: {name} grad")


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "Stack"])
def test_training_graphed_equals_eager(device, kind):
    eager = _build(kind, device)
    model = copy.deepcopy(eager)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    graphed = g8.make_graphed_callables(model, (sample,), fp8_enabled=True, fp8_recipe=BLOCK,
                                        fp8_weight_caching=True)  # fmt: skip
    masters = {"e": g8.MasterWeights(eager), "g": g8.MasterWeights(model)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in masters.items()}
    for step in range(3):
        for mb in range(2):
            x = torch.randn(T, H, dtype=torch.bfloat16, device=device) * 10.0 ** (mb - 1)
            xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
            with g8.fp8_autocast(recipe=BLOCK):
                ye = eager(xe, is_first_microbatch=mb == 0)
            yg = graphed(xg, is_first_microbatch=mb == 0)
            ye.float().square().sum().backward()
            yg.float().square().sum().backward()
            what = f"step {step} mb {mb}"
            assert_bitwise_equal(yg, ye, f"{what}: output")
            assert_bitwise_equal(xg.grad, xe.grad, f"{what}: dgrad")
            _compare(eager, model, what)
        for k in ("e", "g"):
            masters[k].step(opts[k])
            masters[k].zero_grad()
        for me, mg in zip(masters["e"].masters, masters["g"].masters, strict=True):
            assert_bitwise_equal(mg, me, f"step {step}: master")
        _compare(eager, model, f"after step {step}")


@pytest.mark.parametrize("kernels", ["fused", "torch"])
def test_the_weight_blocks_are_read_not_quantized_in_the_graph(device, kernels):
    """A high-precision Linear's forward graph quantizes x (with x.T) and w
    (test_blockwise_graphs: 2 fused kernels, or 3 amaxes of the torch ops); a blockwise FP8
    weight is read as stored: x alone (1, or 2 amaxes: x and x.T)."""
    layer = _build("Linear", device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with blockwise_kernels(kernels):
        graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    op, count = ("graphfp8::blockwise_quantize", 1) if kernels == "fused" else ("aten::amax", 2)
    assert graphed.captured_ops()["forward"].count(op) == count


def test_step_graph_with_master_weights_equals_eager(device):
    """The whole step (3 microbatches, clipping, AdamW on the fp32 masters, the blockwise
    write-back) as one graph, equal to the eager loop bit for bit for 3 steps."""
    n = 3
    with g8.fp8_model_init(recipe=BLOCK):
        eager = TinyLM(device)
    assert sum(isinstance(p, Float8BlockTensor) for p in eager.parameters()) == 5
    model = copy.deepcopy(eager)
    masters = {"e": g8.MasterWeights(eager), "g": g8.MasterWeights(model)}
    opts = {k: adamw(m.parameters(), device) for k, m in masters.items()}
    step = g8.make_graphed_step(model, lm_loss, opts["g"], lm_batch(n, device, 99), n,
                                fp8_enabled=True, fp8_recipe=BLOCK, max_grad_norm=0.5,
                                num_warmup_iters=1, master_weights=masters["g"])  # fmt: skip
    for me, mg in zip(masters["e"].masters, masters["g"].masters, strict=True):
        assert_bitwise_equal(mg, me, "master after capture")  # warmup undone
    _compare(eager, model, "after capture")
    for s in range(3):
        tokens, targets = lm_batch(n, device, s)
        total = torch.zeros((), device=device)
        for i in range(n):
            with g8.fp8_autocast(recipe=BLOCK):
                loss = lm_loss(eager(tokens[i], is_first_microbatch=i == 0), targets[i]) / n
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        masters["e"].step(opts["e"])
        masters["e"].zero_grad()
        assert_bitwise_equal(step((tokens, targets)), total, f"step {s}: loss")
        for me, mg in zip(masters["e"].masters, masters["g"].masters, strict=True):
            assert_bitwise_equal(mg, me, f"step {s}: master")
        _compare(eager, model, f"step {s}")
