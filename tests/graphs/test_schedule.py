"""Pipeline-parallel schedules: graphs per (chunk, microbatch, layer) captured with `order`, equal
to eager bit for bit, and any replay out of the captured order refused (issue 12, item 3)."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from tests.graphs.schedules import ORDER, chunks_of, train_schedule


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interleaved_schedule_equals_eager_without_fp8(device, dtype):
    train_schedule(device, dtype, fp8=False)


@pytest.mark.parametrize("layers", [1, 2])
def test_interleaved_schedule_equals_eager_with_fp8(device, layers):
    train_schedule(device, torch.bfloat16, fp8=True, layers_per_chunk=layers)


def _captured(device="cpu"):
    chunks = chunks_of(16, 1, 2, torch.float32, device)
    samples = tuple((torch.randn(16, 16, device=device, requires_grad=True),) for _ in range(6))
    return g8.make_graphed_callables((chunks[0][0], chunks[1][0]), samples, order=ORDER)


def test_replay_out_of_the_captured_order_raises(device):
    g = _captured(device)  # g[c * 3 + k]: chunk c, microbatch k
    x = torch.randn(16, 16, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"expected the forward of graphed callable 0 \(Linear\)"
                       r" \(chunk 1, microbatch 0, layer 0\) next, got the forward of graphed "
                       r"callable 3 \(Linear\) \(chunk 2, microbatch 0"):  # fmt: skip
        g[3](x)
    y00 = g[0](x)
    y10 = g[3](y00.detach().requires_grad_())
    y01 = g[1](x)
    with pytest.raises(
        RuntimeError,
        match=r"expected the forward of graphed callable 4 .*"
        r"got the forward of graphed callable 2 .*Captured order: \[1, 2, 1",
    ):
        g[2](x)
    y11 = g[4](y01.detach().requires_grad_())
    with pytest.raises(RuntimeError, match=r"expected the backward of graphed callable 3 .*chunk "
                       r"2, microbatch 0.*got the backward of graphed callable 0"):  # fmt: skip
        y00.sum().backward()
    y10.sum().backward()
    y00.sum().backward()
    del y11  # microbatch 1 will not be backpropagated: its backward events are skipped
    g[2](x)


@pytest.mark.parametrize(
    "order, pattern",
    [
        ([1, 2, -2, -1, 1], "the same number of forwards and backwards"),
        ([-1, 1], "a backward of chunk 1 before its forward"),
        ([1, 0, -1], "non-zero ints"),
        ([1, 2, -2, -1], "sample_args needs 2 entries"),
        ([1, 2, 3, -3, -2, -1], "cannot be split into the 3 model chunks"),
    ],
)
def test_bad_orders_raise(order, pattern):
    chunks = chunks_of(16, 1, 2, torch.float32, "cpu")
    samples = tuple((torch.randn(16, 16),) for _ in range(6))
    with pytest.raises(ValueError, match=pattern):
        g8.make_graphed_callables((chunks[0][0], chunks[1][0]), samples, order=order)
