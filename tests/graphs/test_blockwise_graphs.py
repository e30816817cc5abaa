"""Float8BlockScaling inside the graphs: graphed == eager bit for bit for every layer type (per-
callable graphs, with a bf16 and a delayed-scaling callable beside it) and for the whole-step
graph; the tile scales are computed by nodes of the graphs."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8.ops import blockwise
from graphfp8.ops.blockwise_fused import blockwise_kernels
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import train_layers, train_pair, train_side_by_side
from tests.graphs.step_common import (
    adamw,
    compare_step,
    eager_step,
    tiny_lm_step_graph_equals_eager,
)
from tests.modules.common import H, T

BLOCK = g8.Float8BlockScaling()


@pytest.fixture(autouse=True)
def _cuda_gemm_path(monkeypatch):
    """On CUDA these tests run the emulated GEMM unless GRAPHFP8_BLOCKWISE_GEMM chose a path
    (unset, CUDA refuses until the probe has run); the scaled_mm path has its own test below."""
    if not blockwise.GEMM_MODE:
        monkeypatch.setattr(blockwise, "GEMM_MODE", "emulate")


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "SwiGLUMLP",
                                  "TransformerLayer"])  # fmt: skip
@pytest.mark.parametrize("caching", [True, False])
def test_graphed_equals_eager(device, kind, caching):
    train_side_by_side(kind, BLOCK, caching, device)


def test_blockwise_beside_bf16_and_delayed(device):
    """One graph set: a bf16 layer, a blockwise layer, a delayed-scaling layer."""
    train_layers(("Linear", "LayerNormMLP", "Linear"), (False, True, True),
           (None, BLOCK, g8.DelayedScaling()), True, device)  # fmt: skip


@pytest.mark.parametrize("kernels", ["fused", "torch"])
def test_the_scales_are_computed_inside_the_graphs(device, kernels):
    """Each of the 3 GEMMs quantizes its operands in the graph: the fused kernel once per
    tensor (x and x.T from one read, w's blocks and their transpose, dy and dy.T), the torch ops
    one amax per operand; no arena, so no scale update."""
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    with blockwise_kernels(kernels):
        graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    ops = graphed.captured_ops()
    op, (fwd, bwd) = ("graphfp8::blockwise_quantize", (2, 1)) if kernels == "fused" else (
        "aten::amax", (3, 2))  # fmt: skip
    assert (ops["forward"].count(op), ops["backward"].count(op)) == (fwd, bwd)
    assert not any("scale_update" in op for op in ops["forward"] + ops["backward"])


def test_step_graph_equals_eager(device):
    """The whole training step (TinyLM, 3 microbatches) as one graph."""
    tiny_lm_step_graph_equals_eager(device, BLOCK)


@pytest.mark.cuda
def test_cuda_graph_of_the_scaled_mm_path(monkeypatch):
    """torch's cuBLAS blockwise GEMM inside CUDA graphs (shapes in whole 128-tiles): graphed ==
    eager bit for bit, a TransformerLayer of Llama's kind."""
    monkeypatch.setattr(blockwise, "GEMM_MODE", "scaled_mm")
    layer = g8.TransformerLayer(256, 4, 512, num_gqa_groups=2, max_seq_len=128,
                                normalization="RMSNorm", bias=False, activation="swiglu",
                                params_dtype=torch.bfloat16, device="cuda")  # fmt: skip
    sample = torch.randn(2, 128, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    train_pair(layer, sample, BLOCK, True, steps=2, mbs=2)


class _Mixed(torch.nn.Module):
    """A blockwise block (its own fp8_autocast region) feeding a layer under the run's recipe."""

    def __init__(self, device):
        super().__init__()
        self.block = g8.LayerNormMLP(H, 2 * H, params_dtype=torch.bfloat16, device=device)
        self.head = g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)

    def forward(self, x, is_first_microbatch=None):
        with g8.fp8_autocast(recipe=BLOCK):
            h = self.block(x, is_first_microbatch=is_first_microbatch)
        return self.head(h, is_first_microbatch=is_first_microbatch)


def _mse(y, target):
    return torch.nn.functional.mse_loss(y.float(), target.float())


def _compare_mixed(eager, graphed, what: str) -> None:
    """Parameters and the head's own delayed-scaling slots (the capture also gave the block
    slots it never uses, in the same arena: the arenas' layouts differ, their used slots not)."""
    for (name, pe), (_, pg) in zip(eager.named_parameters(), graphed.named_parameters(),
                                   strict=True):  # fmt: skip
        assert_bitwise_equal(pg, pe, f"{what}: {name}")
    me, mg = eager.head.fp8_meta, graphed.head.fp8_meta
    for direction in ("fwd", "bwd"):
        be, bg = getattr(me, direction), getattr(mg, direction)
        assert_bitwise_equal(bg.history(), be.history(), f"{what}: head {direction} history")
        assert_bitwise_equal(bg.scales(), be.scales(), f"{what}: head {direction} scales")


def test_step_graph_mixing_blockwise_and_delayed(device):
    """One step graph, delayed scaling with a blockwise region inside (stateless, so it may nest
    in a capture of another recipe): graphed == eager bit for bit; any other recipe still
    raises."""
    n, recipe = 2, g8.DelayedScaling(amax_history_len=4)
    eager = _Mixed(device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)

    def data(seed):
        gen = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(n, T, H, generator=gen, dtype=torch.bfloat16).to(device)
                     for _ in range(2))  # fmt: skip

    step = g8.make_graphed_step(model, _mse, opt_g, data(0), n, fp8_enabled=True,
                                fp8_recipe=recipe, num_warmup_iters=1,
                                keep_grads_before_clipping=True)  # fmt: skip
    for s in range(2):
        batch = data(s)
        result = eager_step(eager, _mse, opt_e, batch, n, recipe=recipe)
        step(batch)
        compare_step(step, result, f"step {s}")
        _compare_mixed(eager, model, f"step {s}")
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)

    def current_inside(x):
        with g8.fp8_autocast(recipe=g8.Float8CurrentScaling()):
            return layer(x)

    with pytest.raises(RuntimeError, match="or a Float8BlockScaling"):
        g8.make_graphed_callables(current_inside, (sample,), fp8_enabled=True)


def test_microbatch_graph_equals_eager(device):
    """make_graphed_microbatch: forward, loss and backward as one graph, two microbatches per
    step (the weights' blocks quantized by the first, reused by the second: the device flag)."""
    eager = _Mixed(device)
    model = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randn(T, H, generator=gen, dtype=torch.bfloat16).to(device)
                     for _ in range(2)) for _ in range(4)]  # fmt: skip
    graphed = g8.make_graphed_microbatch(model, _mse, batches[0], 2, fp8_enabled=True,
                                         fp8_recipe=BLOCK, fp8_weight_caching=True)  # fmt: skip
    for i, (x, target) in enumerate(batches):
        first = i % 2 == 0
        with g8.fp8_autocast(recipe=BLOCK):
            out = eager(x, is_first_microbatch=first)
        loss = _mse(out, target) / 2
        loss.backward()
        assert_bitwise_equal(graphed((x, target), is_first_microbatch=first), loss, f"mb {i}")
        for (name, pe), (_, pg) in zip(eager.named_parameters(), model.named_parameters(),
                                       strict=True):  # fmt: skip
            assert_bitwise_equal(pg.grad, pe.grad, f"mb {i}: grad {name}")
