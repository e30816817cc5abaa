"""The step graph's work per TransformerLayer per microbatch (benchmarks.census), pinned op by
op so that a change in what a layer launches shows here (issue 33: at most 30 graph nodes per
layer; notes/PERF.md has the census and what each entry is)."""

from __future__ import annotations

import pytest

from benchmarks import census
from benchmarks.opcount import kernels
from graphfp8.ops.switches import kernel_switch

# What one more TransformerLayer adds to each microbatch of the 100m GPT's FP8 step graph, as
# CUDA kernels counted from the captured ops (a graphfp8 op that launches two kernels counts 2).
FP8_LAYER = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": 1,  # cuDNN's forward on the GPU
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": 1,
    "aten::_scaled_mm": 12,  # 4 linears x (forward, dgrad, wgrad)
    "graphfp8::cast_transpose": 5,  # 4 weights (first microbatch only) + the attention output
    "graphfp8::cast_transpose_dbias": 3,  # 3 grads with a bias, dbias summed in the kernel
    "graphfp8::dgelu_cast_transpose_dbias": 1,
    "graphfp8::gelu_cast_transpose": 1,
    "graphfp8::layernorm_bwd": 4,  # 2 norms: rows + the parameter-gradient reduction
    "graphfp8::layernorm_fp8": 4,  # 2 norms: the FP8 rows + their transpose
    "graphfp8::rope_qkv": 1,  # forward
    # backward: dq, dk, dv (where attention left them) rotated back into dqkv in one kernel: no
    # aten::cat of the three before a rope_qkv (issue 33)
    "graphfp8::rope_fp8_backward": 1,
}


@pytest.fixture(scope="module")
def fp8_layer():
    return census.layer_ops(census.model_config("cpu", quick=True), True, "cpu")


def test_the_step_graph_launches_what_the_census_says_per_layer(fp8_layer):
    """The first microbatch of a step casts the 4 weights; the others record no weight cast
    (issue 33: before, 4 no-op cast nodes per layer on every cached microbatch)."""
    assert fp8_layer["kernels"]["first"] == FP8_LAYER
    assert fp8_layer["kernels"]["cached"] == {**FP8_LAYER, "graphfp8::cast_transpose": 1}
    assert census.totals(fp8_layer) == (34, 30)


def test_no_layer_copies_or_fills_in_the_step_graph(fp8_layer):
    assert fp8_layer["memops"] == {"first": {}, "cached": {}}


def test_the_in_kernel_dbias_takes_one_kernel_per_dbias(fp8_layer):
    """Under DBIAS_IN_KERNEL (on by default) each fused dbias is one launch: 4 kernels fewer per
    layer."""
    ops = ["graphfp8::cast_transpose_dbias"] * 3 + ["graphfp8::dgelu_cast_transpose_dbias"]
    assert sum(kernels(ops).values()) == 4
    with kernel_switch("DBIAS_IN_KERNEL", False):
        assert sum(kernels(ops).values()) == 8


def test_the_staged_norm_backward_sums_its_parameter_gradients_in_one_kernel():
    """Under NORM_BWD_STAGED + NORM_BWD_PARAM_IN_KERNEL each norm backward is one launch: 2
    kernels fewer per layer (the parameter-gradient reduction in the staged kernel's tail)."""
    ops = ["graphfp8::layernorm_bwd", "graphfp8::rmsnorm_bwd"]
    assert sum(kernels(ops).values()) == 4  # the defaults: STAGED off
    with kernel_switch("NORM_BWD_BATCHED", True), kernel_switch("NORM_BWD_STAGED", True):
        assert sum(kernels(ops).values()) == 2
        with kernel_switch("NORM_BWD_PARAM_IN_KERNEL", False):
            assert sum(kernels(ops).values()) == 4
