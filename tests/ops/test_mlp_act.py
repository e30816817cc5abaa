"""The MLP activations and their gradients in the input dtype (graphfp8.ops.mlp_act / mlp_dact,
csrc/mlp_act.h) bit for bit against their twins (reference_blockwise.mlp_act / mlp_dact) on
random data: GELU, SwiGLU, GeGLU, odd shapes (F not a multiple of the 16-byte vector, one row,
one column), bf16 / fp32 / fp16; against the kernels whose values they claim (blockwise_act
quantizes mlp_act's a; the per-tensor GLU backward casts mlp_dact's dh) on the device; the
argument checks; on CUDA the vector and scalar paths (misaligned tensors) and a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from graphfp8 import ops, reference
from graphfp8.testing import assert_bitwise_equal
from tests.helpers import HAS_CUDA, assert_outputs_equal

ACTS = ["gelu", "swiglu", "geglu"]
SHAPES = [(1, 1), (3, 7), (5, 300), (64, 8), (130, 256), (257, 129)]
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
E4M3 = torch.float8_e4m3fn


def _case(shape, dtype, activation, seed=0, device="cpu"):
    """(x, dy) of a (rows, F) activation: x of width F (GELU) or 2 F, with a zero row and an
    outlier; dy (rows, F)."""
    gen = torch.Generator().manual_seed(seed)
    rows, f = shape
    x = torch.randn(rows, f if activation == "gelu" else 2 * f, generator=gen) * 3
    x[0] = 0
    if rows > 2:
        x[2, 0] = 30.0
    dy = torch.randn(rows, f, generator=gen)
    return x.to(dtype).to(device), dy.to(dtype).to(device)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_kernels_equal_their_twins(shape, dtype, activation):
    x, dy = _case(shape, dtype, activation)
    what = f"{activation} {shape} {dtype}"
    assert_bitwise_equal(ops.mlp_act(x, activation), reference.mlp_act(x, activation), what)
    dx = ops.mlp_dact(dy, x, activation)
    assert dx.shape == x.shape and dx.dtype == dtype
    assert_bitwise_equal(dx, reference.mlp_dact(dy, x, activation), what)


@pytest.mark.parametrize("activation", ACTS)
def test_the_forward_is_what_blockwise_act_quantizes(device, activation):
    """blockwise_act(x) = 1x128 tiles of mlp_act(x), both layouts, on the device."""
    for shape in ((257, 129), (130, 300)):
        x, _ = _case(shape, torch.bfloat16, activation, seed=1, device=device)
        a = ops.mlp_act(x, activation)
        fused = ops.blockwise_act(x, activation, transpose=True)
        want = ops.blockwise_quantize(a, 1, E4M3, transpose=True)
        names = ("out", "scale_inv", "out_t", "scale_inv_t")
        assert_outputs_equal(tuple(fused), want, names, f"{activation} {shape}")


def _cast_at_one(v: torch.Tensor) -> torch.Tensor:
    return v.float().clamp(-448, 448).to(E4M3)


@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_the_gated_values_are_the_per_tensor_kernels(device, activation):
    """At scale 1 the per-tensor GLU kernels' FP8 bytes and amax are those of mlp_act's a and
    mlp_dact's dh, on the device: the same rounded values (csrc/glu.h)."""
    x, dy = _case((96, 200), torch.bfloat16, activation, seed=2, device=device)
    one = lambda: torch.ones(1, device=device)  # noqa: E731
    amax = torch.zeros(1, device=device)
    a = ops.mlp_act(x, activation)
    out = ops.glu_cast_transpose(x, activation, one(), amax, E4M3)[0]
    assert_bitwise_equal(out, _cast_at_one(a), "a")
    assert amax.item() == a.float().abs().max().item()
    amax.zero_()
    dh = ops.mlp_dact(dy, x, activation)
    out = ops.dglu_cast_transpose_dbias(dy, x, activation, one(), amax, E4M3, dbias=False)[0]
    assert_bitwise_equal(out, _cast_at_one(dh), "dh")
    assert amax.item() == dh.float().abs().max().item()


def test_values_by_hand():
    """SwiGLU at exact points: a zero row stays zero, u = 0 zeroes a and dg, du = silu(g)."""
    x = torch.tensor([[0.0, 0.0, 5.0, 7.0], [2.0, -1.0, 0.0, 3.0]])  # rows [g0 g1 | u0 u1]
    s = torch.sigmoid(torch.tensor([2.0, -1.0], dtype=torch.float64)).tolist()
    a = ops.mlp_act(x, "swiglu")
    assert a[0].tolist() == [0.0, 0.0] and a[1, 0].item() == 0.0
    assert a[1, 1].item() == pytest.approx(-1.0 * s[1] * 3.0, rel=1e-6)
    dx = ops.mlp_dact(torch.ones(2, 2), x, "swiglu")
    assert dx[1, 0].item() == 0.0
    assert dx[1, 1].item() == pytest.approx(3.0 * s[1] * (1.0 - (1.0 - s[1])), rel=1e-6)
    assert dx[1, 2].item() == pytest.approx(2.0 * s[0], rel=1e-6)
    assert dx[1, 3].item() == pytest.approx(-1.0 * s[1], rel=1e-6)


def test_argument_checks():
    x, dy = _case((4, 256), torch.bfloat16, "swiglu")
    out = torch.empty(4, 256, dtype=torch.bfloat16)
    op, dop = torch.ops.graphfp8.mlp_act, torch.ops.graphfp8.mlp_dact
    with pytest.raises(RuntimeError, match="'activation' must be 'gelu', 'swiglu' or 'geglu'"):
        op(x, "relu", out)
    with pytest.raises(RuntimeError, match="must have an even width"):
        op(x[:, :511].contiguous(), "geglu", out)
    with pytest.raises(RuntimeError, match=r"'out' must have shape \[4, 512\]"):
        op(x, "gelu", out)
    with pytest.raises(RuntimeError, match="'out' must have the dtype of 'x'"):
        op(x, "swiglu", out.float())
    with pytest.raises(RuntimeError, match="'x' must be contiguous"):
        op(x.t(), "gelu", out)
    with pytest.raises(RuntimeError, match=r"'out' must have shape \[4, 512\]"):
        dop(dy, x, "swiglu", out)
    with pytest.raises(RuntimeError, match=r"'dy' must be \(4, 256\) of the dtype of 'x'"):
        dop(dy.float(), x, "swiglu", torch.empty_like(x))
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.mlp_act(x, "relu")
    with pytest.raises(ValueError, match="must be 2-D"):
        ops.mlp_dact(dy, x[None], "gelu")


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a contiguous tensor that starts one element into its storage (no aligned
    16-byte vectors: the kernels' scalar path)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_cuda_vector_and_scalar_paths(dtype, activation):
    """CUDA: the vector path (F a multiple of the vector) and the scalar one (odd F, misaligned
    tensors) give the same bits, and the CPU kernels' values but for the transcendentals' last
    bits (expf / tanhf against double)."""
    for shape in ((384, 512), (257, 129), (1, 3), (130, 1000)):
        x, dy = _case(shape, dtype, activation, seed=3, device="cuda")
        a, dx = ops.mlp_act(x, activation), ops.mlp_dact(dy, x, activation)
        xm, dym = _misaligned(x), _misaligned(dy)
        assert_bitwise_equal(ops.mlp_act(xm, activation), a, f"{shape} a")
        assert_bitwise_equal(ops.mlp_dact(dym, xm, activation), dx, f"{shape} dx")
        tol = dict(rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-5)
        torch.testing.assert_close(a.cpu(), reference.mlp_act(x.cpu(), activation), **tol)
        torch.testing.assert_close(dx.cpu(), reference.mlp_dact(dy.cpu(), x.cpu(), activation),
                                   **tol)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", ACTS)
def test_cuda_in_a_cuda_graph(activation):
    x, dy = _case((512, 1024), torch.bfloat16, activation, device="cuda")
    ops.mlp_act(x, activation), ops.mlp_dact(dy, x, activation)  # warm up the launches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a, dx = ops.mlp_act(x, activation), ops.mlp_dact(dy, x, activation)
    x.mul_(2)
    dy.mul_(-1)
    graph.replay()
    assert_bitwise_equal(a, ops.mlp_act(x, activation), "a")
    assert_bitwise_equal(dx, ops.mlp_dact(dy, x, activation), "dx")
