"""rope_qkv against its PyTorch twin (bit for bit), its backward (the transposed rotation), and
bad input."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.modules.transformer import rope_tables
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import HP_DTYPES


def _inputs(batch, seq, heads, head_dim, dtype, device, extra_rows=3, kv_heads=None):
    width = (heads + 2 * (kv_heads or heads)) * head_dim
    qkv = torch.randn(batch, seq, width, device=device).to(dtype) * 4
    cos, sin = rope_tables(seq + extra_rows, head_dim, 500.0, torch.float32, device)
    return qkv, cos, sin


# (batch, seq, heads, head_dim, kv_heads): kv_heads < heads is grouped-query attention.
SHAPES = [(2, 24, 2, 16, 2), (1, 7, 3, 6, 3), (3, 1, 1, 2, 1), (1, 130, 4, 64, 4),
          (2, 24, 4, 16, 1), (1, 33, 6, 64, 2), (2, 5, 4, 6, 2)]  # fmt: skip


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_matches_twin_bitwise(device, dtype, shape, inverse):
    *dims, kv = shape
    qkv, cos, sin = _inputs(*dims, dtype, device, kv_heads=kv)
    heads, head_dim = shape[2], shape[3]
    want = torch.empty_like(qkv)
    reference.rope_qkv(qkv, cos, sin, heads, inverse, want, kv)
    assert_bitwise_equal(ops.rope_qkv(qkv, cos, sin, heads, inverse, num_kv_heads=kv), want)
    # v is copied untouched, and position 0 is the identity for q and k too
    v_from = (heads + kv) * head_dim
    assert_bitwise_equal(want[..., v_from:], qkv[..., v_from:])
    assert_bitwise_equal(want[:, 0], qkv[:, 0])


def test_gqa_rotates_every_q_and_k_head_alike(device):
    """With G < H each of the H q heads and G k heads is rotated exactly as a one-head call
    rotates it (the head layout: q heads, then k heads, then v heads)."""
    b, s, h, g, d = 2, 9, 4, 2, 8
    qkv, cos, sin = _inputs(b, s, h, d, torch.float32, device, kv_heads=g)
    got = ops.rope_qkv(qkv, cos, sin, h, num_kv_heads=g).view(b, s, h + 2 * g, d)
    rows = qkv.view(b, s, h + 2 * g, d)
    for j in range(h + g):
        one = rows[:, :, j].repeat(1, 1, 3).contiguous()  # q = k = v = this head
        want = ops.rope_qkv(one, cos, sin, 1).view(b, s, 3, d)[:, :, 0]
        assert_bitwise_equal(got[:, :, j], want, f"head row {j}")


def test_in_place(device):
    qkv, cos, sin = _inputs(2, 16, 2, 8, torch.bfloat16, device)
    want = ops.rope_qkv(qkv, cos, sin, 2)
    ops.rope_qkv(qkv, cos, sin, 2, out=qkv)
    assert_bitwise_equal(qkv, want)


def test_inverse_is_the_transpose(device):
    """<rope(x), g> == <x, rope_inverse(g)>, the identity the backward relies on; and the inverse
    undoes the forward (a rotation)."""
    x, cos, sin = _inputs(2, 20, 2, 16, torch.float32, device)
    g = torch.randn_like(x)
    lhs = (ops.rope_qkv(x, cos, sin, 2).double() * g.double()).sum()
    rhs = (x.double() * ops.rope_qkv(g, cos, sin, 2, inverse=True).double()).sum()
    torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-3)
    back = ops.rope_qkv(ops.rope_qkv(x, cos, sin, 2), cos, sin, 2, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_module_backward_uses_inverse(device):
    """The layer's autograd Function: grad of sum(rope(x) * g) is rope_inverse(g)."""
    from graphfp8.modules.transformer import _RopeQKV

    x, cos, sin = _inputs(1, 16, 2, 8, torch.bfloat16, device)
    x.requires_grad_()
    g = torch.randn_like(x)
    (_RopeQKV.apply(x, cos, sin, 2) * g).sum().backward()
    assert_bitwise_equal(x.grad, ops.rope_qkv(g, cos, sin, 2, inverse=True))


# (change of the valid arguments, the error it raises, the message).
ERROR_CASES = [
    (lambda q, c, s: (q.to(torch.int32), c, s, 2), TypeError, "float32, bfloat16 or float16"),
    (lambda q, c, s: (q[0], c, s, 2), ValueError, r"must be \(batch, seq, 3 \* hidden\)"),
    (lambda q, c, s: (q, c, s, 5), ValueError, r"is not \(num_heads \+ 2 \* num_kv_heads\)"),
    (lambda q, c, s: (q, c[:4], s, 2), ValueError, "argument 'cos' must be"),
    (lambda q, c, s: (q, c, s.double(), 2), TypeError, "argument 'sin' must be float32"),
    (lambda q, c, s: (q.transpose(0, 1), c, s, 2), ValueError, "must be contiguous"),
    (lambda q, c, s: (q, c.cpu() if q.is_cuda else c.t(), s, 2), ValueError, "argument 'cos'"),
]


@pytest.mark.parametrize("change, error, match", ERROR_CASES)
def test_errors(device, change, error, match):
    qkv, cos, sin = _inputs(2, 16, 2, 8, torch.bfloat16, device)
    with pytest.raises(error, match=match):
        ops.rope_qkv(*change(qkv, cos, sin))


def test_odd_head_dim_rejected():
    qkv = torch.randn(1, 4, 3 * 2 * 3)
    cos, sin = torch.ones(4, 3), torch.zeros(4, 3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        ops.rope_qkv(qkv, cos, sin, 2)


@pytest.mark.parametrize("change, error, match", ERROR_CASES)
def test_op_raises_what_the_wrapper_raises(device, change, error, match):
    """The wrapper has no checks of its own: a direct torch.ops call raises the same errors, from
    csrc/ops/. (On the GPU machine, messages that streamed numbers once crashed the process instead
    of raising: csrc/ops/ formats them with std::to_string.)"""
    qkv, cos, sin = _inputs(2, 16, 2, 8, torch.bfloat16, device)
    args = change(qkv, cos, sin)
    with pytest.raises(error, match=match):
        torch.ops.graphfp8.rope_qkv(*args, False, torch.empty_like(args[0]))


@pytest.mark.parametrize(
    "out, error, match",
    [
        (lambda q: q.float(), TypeError, "argument 'out' must have the dtype of 'qkv'"),
        (lambda q: q[:, :8], ValueError, r"argument 'out' must have shape \[2, 16, 48\]"),
        (lambda q: q.transpose(0, 1).contiguous().transpose(0, 1), ValueError,
         "argument 'out' must be contiguous"),
    ],
)  # fmt: skip
def test_bad_out(device, out, error, match):
    qkv, cos, sin = _inputs(2, 16, 2, 8, torch.bfloat16, device)
    with pytest.raises(error, match=match):
        ops.rope_qkv(qkv, cos, sin, 2, out=torch.empty_like(out(qkv)))
