"""graphfp8.ops.grad_fold_ (the copy-first gradient fold of graphed callables, switch
GRAD_FOLD_COPY_FIRST): against its twin (torch's copy_ / add_) bit for bit on every device, NaN,
infinities and signed zeros included, on vector and scalar paths; in a CUDA graph the flag read
at replay; its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import CUDA_PARAM

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 16-byte vectors, a length that is no multiple of the vector, a 2-D weight
SHAPES = [(1024,), (1001,), (96, 40)]
SPECIAL = [math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 65504.0, -1e-40]


def _pair(shape, dtype, device, seed=0):
    """Random buffer and gradient with NaN, infinities, signed zeros and overflowing sums in the
    first elements of each."""
    torch.manual_seed(seed)
    b = torch.randn(shape, dtype=dtype, device=device) * 100
    g = torch.randn(shape, dtype=dtype, device=device) * 100
    special = torch.tensor(SPECIAL, dtype=dtype)
    b.view(-1)[: len(SPECIAL)] = special.to(device)
    g.view(-1)[: len(SPECIAL)] = special.flip(0).to(device)
    return b, g


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_folds_like_its_twin(device, dtype, shape, first):
    b, g = _pair(shape, dtype, device)
    flag = torch.full((1,), first, dtype=torch.int32, device=device)
    want = b.clone()
    reference.grad_fold_(want, g, flag)
    assert ops.grad_fold_(b, g, flag) is b
    assert_bitwise_equal(b, want, f"first={first}")
    if first:
        assert_bitwise_equal(b, g, "the copy keeps the gradient's bits")


def test_unaligned_views_take_the_scalar_path(device):
    """A buffer and gradient 2 bytes past a 16-byte boundary (bf16)."""
    b, g = _pair((1025,), torch.bfloat16, device)
    b, g = b[1:], g[1:]
    for first in (0, 1):
        flag = torch.full((1,), first, dtype=torch.int32, device=device)
        want = b.clone()
        reference.grad_fold_(want, g, flag)
        ops.grad_fold_(b, g, flag)
        assert_bitwise_equal(b, want, f"first={first}")


def test_a_strided_gradient_is_made_contiguous(device):
    b, g = _pair((32, 48), torch.float32, device)
    gt = g.t().contiguous().t()  # the same values, column-major
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    want = b.clone().add_(g)
    ops.grad_fold_(b, gt, flag)
    assert_bitwise_equal(b, want)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda d: (torch.zeros(4, device=d), torch.zeros(4, device=d, dtype=torch.bfloat16),
                    torch.zeros(1, dtype=torch.int32, device=d)), "like the buffer, got"),
        (lambda d: (torch.zeros(4, device=d), torch.zeros(5, device=d),
                    torch.zeros(1, dtype=torch.int32, device=d)), "must have shape"),
        (lambda d: (torch.zeros(4, device=d), torch.zeros(4, device=d),
                    torch.zeros(1, device=d)), "'first' must be int32"),
        (lambda d: (torch.zeros(4, device=d), torch.zeros(4, device=d),
                    torch.zeros(2, dtype=torch.int32, device=d)), "one element"),
        (lambda d: (torch.zeros(4, 4, device=d).t(), torch.zeros(4, 4, device=d),
                    torch.zeros(1, dtype=torch.int32, device=d)), "'buffer' must be contiguous"),
        (lambda d: (torch.zeros(4, dtype=torch.int32, device=d),
                    torch.zeros(4, dtype=torch.int32, device=d),
                    torch.zeros(1, dtype=torch.int32, device=d)), "float32, bfloat16 or float16"),
    ],
)  # fmt: skip
def test_argument_checks(device, make, match):
    with pytest.raises((TypeError, ValueError, RuntimeError), match=match):
        ops.grad_fold_(*make(device))


@pytest.mark.parametrize("device", [CUDA_PARAM])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cuda_graph_reads_the_flag_at_replay(device, dtype):
    """One captured fold copies or adds as the flag stands when it replays."""
    b, g = _pair((4096,), dtype, device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.grad_fold_(b, g, flag)
    for first in (1, 0, 0, 1):
        flag.fill_(first)
        want = b.clone()
        reference.grad_fold_(want, g, flag)
        graph.replay()
        assert_bitwise_equal(b, want, f"replay with first={first}")
