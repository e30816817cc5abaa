"""Float8BlockScaling inside the graphs: graphed == eager bit for bit for every layer type (per-
callable graphs, with a bf16 and a delayed-scaling callable beside it) and for the whole-step
graph; the tile scales are computed by nodes of the graphs."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from tests.graphs.common import train_layers, train_pair, train_side_by_side
from tests.graphs.step_common import (
    TinyLM,
    adamw,
    compare_step,
    compare_training_state,
    eager_step,
    lm_batch,
    lm_loss,
)
from tests.modules.common import H, T

BLOCK = g8.Float8BlockScaling()


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "SwiGLUMLP",
                                  "TransformerLayer"])  # fmt: skip
@pytest.mark.parametrize("caching", [True, False])
def test_graphed_equals_eager(device, kind, caching):
    train_side_by_side(kind, BLOCK, caching, device)


def test_blockwise_beside_bf16_and_delayed(device):
    """One graph set: a bf16 layer, a blockwise layer, a delayed-scaling layer."""
    train_layers(("Linear", "LayerNormMLP", "Linear"), (False, True, True),
           (None, BLOCK, g8.DelayedScaling()), True, device)  # fmt: skip


def test_the_scales_are_computed_inside_the_graphs(device):
    """Each of the 3 GEMMs quantizes its operands in the graph: per operand one amax over its
    tiles; no arena, so no scale update."""
    layer = g8.Linear(H, H, params_dtype=torch.bfloat16, device=device)
    sample = torch.randn(T, H, dtype=torch.bfloat16, device=device, requires_grad=True)
    graphed = g8.make_graphed_callables(layer, (sample,), fp8_enabled=True, fp8_recipe=BLOCK)
    ops = graphed.captured_ops()
    assert ops["forward"].count("aten::amax") == 3  # x, w, x.T
    assert ops["backward"].count("aten::amax") == 2  # dy, dy.T
    assert not any("scale_update" in op for op in ops["forward"] + ops["backward"])


def test_step_graph_equals_eager(device):
    """The whole training step (TinyLM, 3 microbatches) as one graph."""
    n = 3
    eager = TinyLM(device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    step = g8.make_graphed_step(model, lm_loss, opt_g, lm_batch(n, device, 99), n,
                                fp8_enabled=True, fp8_recipe=BLOCK, num_warmup_iters=1,
                                keep_grads_before_clipping=True)  # fmt: skip
    compare_training_state(eager, model, opt_e, opt_g, "after capture")
    for s in range(3):
        batch = lm_batch(n, device, s)
        result = eager_step(eager, lm_loss, opt_e, batch, n, recipe=BLOCK)
        step(batch)
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")


@pytest.mark.cuda
def test_cuda_graph_of_the_scaled_mm_path(monkeypatch):
    """torch's cuBLAS blockwise GEMM inside CUDA graphs (shapes in whole 128-tiles): graphed ==
    eager bit for bit, a TransformerLayer of Llama's kind."""
    from graphfp8.ops import blockwise

    monkeypatch.setattr(blockwise, "GEMM_MODE", "scaled_mm")
    layer = g8.TransformerLayer(256, 4, 512, num_gqa_groups=2, max_seq_len=128,
                                normalization="RMSNorm", bias=False, activation="swiglu",
                                params_dtype=torch.bfloat16, device="cuda")  # fmt: skip
    sample = torch.randn(2, 128, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    train_pair(layer, sample, BLOCK, True, steps=2, mbs=2)
