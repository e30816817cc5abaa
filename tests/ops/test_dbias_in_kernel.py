"""The fused dbias summed inside the tile kernel by the last block of each column of tiles (kernel
switch DBIAS_IN_KERNEL, csrc/cuda/dbias.cuh) against the second kernel it replaces: dbias and
every other output bit for bit, eagerly, again on the same stream (the counters reset), between
shapes of other widths, and inside CUDA graphs (captured after an eager use on the capture
stream: in-kernel; on a stream never used eagerly: the second kernel). GPU only: the CPU kernels
sum in one pass and ignore the switch."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops
from graphfp8.ops.switches import kernel_switch
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import CUDA_PARAM, HP_DTYPES

E5M2 = torch.float8_e5m2
# Vector tiles (128 x 64) whole and partial, scalar tiles (64 x 64; dims not multiples of 16),
# row tiles more and fewer than the in-kernel sum's batch of 8, and a wide tensor.
SHAPES = [(16, 16), (144, 80), (1040, 2064), (2048, 96), (200, 70), (1100, 33), (256, 8192)]
OPS = ["cast_transpose_dbias", "dgelu_cast_transpose_dbias", "dglu swiglu", "dglu geglu"]


def _run(op: str, dy: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    one, amax = torch.ones(1, device=dy.device), torch.zeros(1, device=dy.device)
    if op == "cast_transpose_dbias":
        out = ops.cast_transpose_dbias(dy, one, amax, E5M2)
    elif op == "dgelu_cast_transpose_dbias":
        out = ops.dgelu_cast_transpose_dbias(dy, x, one, amax, E5M2)
    else:
        h = torch.cat([x, x.flip(0)], dim=1)  # (rows, 2F): gate and up differ
        out = ops.dglu_cast_transpose_dbias(dy, h, op.split()[1], one, amax, E5M2)
    return [*out, amax]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    dy = (torch.randn(shape, generator=g) * 4).to(dtype).cuda()
    x = (torch.randn(shape, generator=g) * 2).to(dtype).cuda()
    return dy, x


def _check(got, want, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{what}: output {i}")


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_in_kernel_dbias_equals_the_second_kernel(device, op, dtype, shape):
    dy, x = _inputs(shape, dtype)
    with kernel_switch("DBIAS_IN_KERNEL", False):
        want = _run(op, dy, x)
    with kernel_switch("DBIAS_IN_KERNEL", True):
        got = _run(op, dy, x)
        again = _run(op, dy, x)  # the counters were left at zero
    _check(got, want, f"{op} {shape} {dtype}")
    _check(again, want, f"{op} {shape} {dtype}, second call")


@pytest.mark.parametrize("device", [CUDA_PARAM])
def test_widths_in_turn_share_the_stream_counters(device):
    """Calls of other widths one after another on one stream: each finds its counters zero."""
    cases = [(_inputs(s, torch.bfloat16, seed=i), s) for i, s in enumerate(SHAPES)]
    with kernel_switch("DBIAS_IN_KERNEL", False):
        want = [_run(op, *io) for op in OPS[:2] for io, _ in cases]
    with kernel_switch("DBIAS_IN_KERNEL", True):
        got = [_run(op, *io) for op in OPS[:2] for io, _ in cases]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _check(g, w, f"call {i}")


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("warm", [True, False], ids=["eager-use-first", "capture-first"])
def test_in_kernel_dbias_in_a_cuda_graph(device, warm):
    """warm: an eager call on the capture stream first (as graphfp8's warmup does), so the graph
    holds the in-kernel sums; else the capture is the stream's first use and takes the second
    kernel. Either way every replay equals the eager result on new data."""
    shape = (1040, 2064)
    dy, x = _inputs(shape, torch.bfloat16)
    stream = torch.cuda.Stream()
    with kernel_switch("DBIAS_IN_KERNEL", True):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if warm:
                _run("dgelu_cast_transpose_dbias", dy, x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs = _run("dgelu_cast_transpose_dbias", dy, x)
        torch.cuda.current_stream().wait_stream(stream)
        for seed in (1, 2):
            new_dy, new_x = _inputs(shape, torch.bfloat16, seed)
            dy.copy_(new_dy)
            x.copy_(new_x)
            outs[-1].zero_()  # the amax accumulates; start both from zero
            graph.replay()
            with kernel_switch("DBIAS_IN_KERNEL", False):
                want = _run("dgelu_cast_transpose_dbias", new_dy, new_x)
            _check([o.clone() for o in outs], want, f"replay with seed {seed}")
