"""The batched norm backward (kernel switch NORM_BWD_BATCHED, csrc/cuda/norm_bwd_batched.cu)
against the kernel it replaces: dx, dgamma and dbeta bit for bit, on every path its layout
takes (1, 2 or 4 lanes per thread, several row slots per block, rows in batches with a ragged
tail, fewer rows than blocks, unvectorised hidden sizes, every dtype, dresidual, RMSNorm,
zero-centred gamma), and bit for bit on repeat; its staged variant (kernel switch
NORM_BWD_STAGED: each thread's next rows copied into shared memory by cp.async) against the
batched kernel the same way, alone and with dgamma and dbeta summed by its last blocks (kernel
switch NORM_BWD_PARAM_IN_KERNEL: per-stream counters, left zero for the next call), also in CUDA
graphs. GPU only: the CPU has one backward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from graphfp8 import ops
from graphfp8.ops.switches import kernel_switch, switch_on
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import CUDA_PARAM

SHAPES = [
    ((8192, 1024), torch.bfloat16),  # 2 row slots per block, 16 rows per slot
    ((8192, 4096), torch.bfloat16),  # 2 lanes per thread
    ((2048, 8192), torch.bfloat16),  # 4 lanes per thread
    ((1100, 8192), torch.bfloat16),  # a ragged last batch
    ((777, 2048), torch.float32),
    ((3000, 1536), torch.float16),
    ((513, 8190), torch.bfloat16),  # unvectorised, 4 lanes per thread
    ((100, 64), torch.bfloat16),  # fewer rows than blocks, lanes narrower than a warp
    ((37, 53), torch.float32),
    ((1100, 4096), torch.bfloat16),  # staged: 2 lanes per thread, a ragged last batch
    ((3001, 1024), torch.float16),  # staged: the slots of a block with unequal rows
]
STAGED = {"NORM_BWD_BATCHED": True, "NORM_BWD_STAGED": True, "NORM_BWD_PARAM_IN_KERNEL": False}


def _inputs(shape, dtype, rms, dresidual, zero_centered):
    rows, hidden = shape
    x = (torch.randn(shape, device="cuda") * 3 + 1).to(dtype)
    gamma = (torch.randn(hidden, device="cuda") * 0.2 + (0.0 if zero_centered else 1.0)).to(dtype)
    beta = torch.randn(hidden, device="cuda").to(dtype)
    one, zero = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    if rms:
        fwd = ops.rmsnorm_fp8(x, gamma, 1e-5, one, zero, torch.float8_e4m3fn)
    else:
        fwd = ops.layernorm_fp8(x, gamma, beta, 1e-5, one, zero, torch.float8_e4m3fn)
    dy = (torch.randn(shape, device="cuda") * 4).to(dtype)
    dres = torch.randn(shape, device="cuda").to(dtype) if dresidual else None
    return dy, x, fwd.mu, fwd.rsigma, gamma, dres


def _backward(args, rms, zero_centered):
    dy, x, mu, rsigma, gamma, dres = args
    kw = dict(zero_centered_gamma=zero_centered, dresidual=dres)
    if rms:
        return ops.rmsnorm_bwd(dy, x, rsigma, gamma, **kw)
    return ops.layernorm_bwd(dy, x, mu, rsigma, gamma, **kw)


OPTIONS = [(False, False, False), (True, True, True), (False, True, False)]


def _switched(settings: dict[str, bool]):
    stack = contextlib.ExitStack()
    for name, on in settings.items():
        stack.enter_context(kernel_switch(name, on))
    return stack


def _assert_variant_equals(args, rms, zero_centered, base: dict, variant: dict, what: str):
    """dx, dgamma, dbeta under the switch settings `variant` against `base`, bit for bit, and
    again on repeat."""
    with _switched(base):
        want = _backward(args, rms, zero_centered)
    with _switched(variant):
        got = _backward(args, rms, zero_centered)
        again = _backward(args, rms, zero_centered)
    for name, g, a, w in zip(("dx", "dgamma", "dbeta"), got, again, want, strict=False):
        assert_bitwise_equal(g, w, f"{name} vs {what}")
        assert_bitwise_equal(a, g, f"{name} on repeat")


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("shape, dtype", SHAPES)
@pytest.mark.parametrize("rms, dresidual, zero_centered", OPTIONS)
def test_batched_backward_equals_the_old_kernel(device, shape, dtype, rms, dresidual,
                                                zero_centered):  # fmt: skip
    args = _inputs(shape, dtype, rms, dresidual, zero_centered)
    _assert_variant_equals(args, rms, zero_centered, {"NORM_BWD_BATCHED": False},
                           {"NORM_BWD_BATCHED": True}, "the old kernel")  # fmt: skip


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("shape, dtype", SHAPES)
@pytest.mark.parametrize("rms, dresidual, zero_centered", OPTIONS)
@pytest.mark.parametrize("in_kernel", [False, True], ids=["param-kernel", "param-in-kernel"])
def test_staged_backward_equals_the_batched_kernel(device, shape, dtype, rms, dresidual,
                                                   zero_centered, in_kernel):  # fmt: skip
    args = _inputs(shape, dtype, rms, dresidual, zero_centered)
    batched = {**STAGED, "NORM_BWD_STAGED": False}
    staged = {**STAGED, "NORM_BWD_PARAM_IN_KERNEL": in_kernel}
    _assert_variant_equals(args, rms, zero_centered, batched, staged, "the batched kernel")


@pytest.mark.parametrize("device", [CUDA_PARAM])
def test_staged_widths_in_turn_share_the_stream_counters(device):
    """Calls of other widths one after another on one stream: each finds the counters zero."""
    cases = [_inputs(shape, dtype, False, False, False) for shape, dtype in SHAPES]
    with _switched({**STAGED, "NORM_BWD_STAGED": False}):
        want = [_backward(args, False, False) for args in cases]
    with _switched({**STAGED, "NORM_BWD_PARAM_IN_KERNEL": True}):
        got = [_backward(args, False, False) for args in cases]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(("dx", "dgamma", "dbeta"), g, w, strict=True):
            assert_bitwise_equal(a, b, f"call {i}: {name}")


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("warm", [True, False], ids=["eager-use-first", "capture-first"])
def test_staged_backward_in_a_cuda_graph(device, warm):
    """warm: an eager call on the capture stream first, so the graph holds the in-kernel
    parameter sums; else the capture is the stream's first use and takes the second kernel.
    Every replay equals the batched kernel's eager result on new data."""
    shape, dtype = (8192, 1024), torch.bfloat16
    args = _inputs(shape, dtype, False, True, False)
    stream = torch.cuda.Stream()
    with _switched({**STAGED, "NORM_BWD_PARAM_IN_KERNEL": True}):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if warm:
                _backward(args, False, False)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = _backward(args, False, False)
        torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        torch.manual_seed(seed)
        new = _inputs(shape, dtype, False, True, False)
        for dst, src in zip(args, new, strict=True):
            dst.copy_(src)
        graph.replay()
        with _switched({**STAGED, "NORM_BWD_STAGED": False}):
            want = _backward(args, False, False)
        for name, g, w in zip(("dx", "dgamma", "dbeta"), outs, want, strict=True):
            assert_bitwise_equal(g, w, f"replay {seed}: {name}")


def test_switch_sets_and_restores():
    before = switch_on("NORM_BWD_BATCHED")  # off unless GRAPHFP8_NORM_BWD_BATCHED=1
    with kernel_switch("NORM_BWD_BATCHED", not before):
        assert switch_on("NORM_BWD_BATCHED") is not before
    assert switch_on("NORM_BWD_BATCHED") is before
    with pytest.raises(RuntimeError, match="no kernel switch named"):
        with kernel_switch("NO_SUCH_SWITCH"):
            pass
