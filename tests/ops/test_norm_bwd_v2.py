"""The v2 norm backward (kernel switch NORM_BWD_V2, csrc/cuda/norm_bwd_v2.cu: two batches of rows
in flight in registers, 16-bit vectorised rows to hidden 4096) against the kernels it replaces:
dx, dgamma and dbeta bit for bit against the batched kernel and the original one, on every path
its layout takes (1 or 2 lanes per thread, several row slots per block, an odd number of row
batches and a ragged last one, fewer rows than blocks, idle lanes where the hidden size is not a
power of two, the division by a hidden size that is not one), RMSNorm and LayerNorm with and
without dresidual, zero-centred gamma, non-finite gradients, on repeat and in a CUDA graph; the
shapes it does not take (fp32, unvectorised, hidden 8192) still equal the old kernel. GPU only:
the CPU has one backward."""

from __future__ import annotations

import pytest
import torch

from graphfp8.ops.switches import kernel_switch
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import CUDA_PARAM
from tests.ops.test_norm_bwd_batched import _backward, _inputs, _switched

SHAPES = [
    ((4096, 2048), torch.bfloat16),  # Llama-1B: 16 rows per block, 8 batches of 2
    ((8192, 4096), torch.bfloat16),  # Llama-8B: 2 lanes per thread, 32 batches of 1
    ((1100, 4096), torch.float16),  # 2 lanes, blocks of 4 and 5 rows
    ((777, 2048), torch.bfloat16),  # an odd number of batches, a half-empty last one
    ((3001, 1024), torch.float16),  # 2 row slots per block with unequal rows
    ((513, 1536), torch.bfloat16),  # idle lanes (192 of 256 hold columns), sums divided by 1536
    ((300, 3072), torch.float16),  # 2 lanes, the second idle in a quarter of the threads
    ((100, 64), torch.bfloat16),  # fewer rows than blocks, lanes narrower than a warp
    ((2, 2048), torch.bfloat16),  # one batch per block
    ((777, 2048), torch.float32),  # not taken: the batched kernel
    ((1100, 8192), torch.bfloat16),  # not taken: 4 lanes per thread
    ((513, 2044), torch.bfloat16),  # not taken: unvectorised
]
OPTIONS = [(False, False, False), (True, True, True), (False, True, False), (True, False, True)]
OLD = {"NORM_BWD_V2": False, "NORM_BWD_BATCHED": False}
BATCHED = {"NORM_BWD_V2": False, "NORM_BWD_BATCHED": True}
V2 = {"NORM_BWD_V2": True}


def _assert_v2_equals(args, rms, zero_centered):
    """dx, dgamma (, dbeta) with NORM_BWD_V2 on against the old and the batched kernel, bit for
    bit, and again on repeat."""
    with _switched(OLD):
        old = _backward(args, rms, zero_centered)
    with _switched(BATCHED):
        batched = _backward(args, rms, zero_centered)
    with _switched(V2):
        got = _backward(args, rms, zero_centered)
        again = _backward(args, rms, zero_centered)
    names = ("dx", "dgamma", "dbeta")
    for name, g, a, o, b in zip(names, got, again, old, batched, strict=False):
        assert_bitwise_equal(g, o, f"{name} vs the old kernel")
        assert_bitwise_equal(g, b, f"{name} vs the batched kernel")
        assert_bitwise_equal(a, g, f"{name} on repeat")


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("shape, dtype", SHAPES)
@pytest.mark.parametrize("rms, dresidual, zero_centered", OPTIONS)
def test_v2_backward_equals_the_old_kernels(device, shape, dtype, rms, dresidual, zero_centered):
    args = _inputs(shape, dtype, rms, dresidual, zero_centered)
    _assert_v2_equals(args, rms, zero_centered)


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("rms", [False, True])
def test_v2_backward_with_non_finite_gradients(device, rms):
    """NaN and inf in dy and dresidual: whole rows of NaN dx (the row sums), NaN and inf column
    sums, each rounded to 16 bits as the old kernels round them (NaN bits included)."""
    args = list(_inputs((4096, 2048), torch.bfloat16, rms, True, False))
    dy, dres = args[0], args[5]
    dy[5, 7] = float("nan")
    dy[300, 0] = float("inf")
    dy[301, 2047] = -float("inf")
    dres[9, 100] = float("nan")
    dres[4000, 3] = float("inf")
    _assert_v2_equals(tuple(args), rms, False)


@pytest.mark.parametrize("device", [CUDA_PARAM])
def test_v2_takes_precedence_over_the_staged_kernel(device):
    args = _inputs((8192, 1024), torch.bfloat16, False, True, False)
    with _switched({**BATCHED, "NORM_BWD_STAGED": True, "NORM_BWD_PARAM_IN_KERNEL": True}):
        staged = _backward(args, False, False)
    with _switched({**V2, "NORM_BWD_STAGED": True, "NORM_BWD_PARAM_IN_KERNEL": True}):
        got = _backward(args, False, False)
    for name, g, w in zip(("dx", "dgamma", "dbeta"), got, staged, strict=True):
        assert_bitwise_equal(g, w, f"{name} vs the staged kernel")


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("rms", [False, True])
def test_v2_backward_in_a_cuda_graph(device, rms):
    """Captured with NORM_BWD_V2 on; every replay on new data equals the old kernel's eager
    result."""
    shape, dtype = (4096, 2048), torch.bfloat16
    args = _inputs(shape, dtype, rms, True, False)
    stream = torch.cuda.Stream()
    with kernel_switch("NORM_BWD_V2", True):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _backward(args, rms, False)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = _backward(args, rms, False)
        torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        torch.manual_seed(seed)
        new = _inputs(shape, dtype, rms, True, False)
        for dst, src in zip(args, new, strict=True):
            if dst is not None:
                dst.copy_(src)
        graph.replay()
        with _switched(OLD):
            want = _backward(args, rms, False)
        for name, g, w in zip(("dx", "dgamma", "dbeta"), outs, want, strict=False):
            assert_bitwise_equal(g, w, f"replay {seed}: {name}")
