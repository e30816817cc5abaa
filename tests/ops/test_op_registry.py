"""Every op of torch.ops.graphfp8 agrees wherever it is written (docs/architecture.md, "The C++ /
CUDA side"): a fake that gives the real op's outputs under FakeTensorMode, a twin in
graphfp8/reference.py (reference_attention.py for attention) with the schema's argument names,
one Python wrapper in graphfp8.ops, a CPU kernel and, built with CUDA, a CUDA kernel. The same
checks run on scratch ops with a wrong fake and wrong twins, so that they are seen to fail."""

from __future__ import annotations

import inspect
import pkgutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import graphfp8.ops
from graphfp8 import ops, reference, reference_attention
from tests.helpers import HAS_CUDA
from tests.ops.attention_data import backward_scales, forward_case, quantized

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Twins not named after their op: FP8 attention's float64 twins return what the op writes.
TWINS = {
    "sdpa_fp8_fwd": reference_attention.sdpa_fp8_forward,
    "sdpa_fp8_bwd": reference_attention.sdpa_fp8_backward,
}


def op_names(namespace: str = "graphfp8") -> list[str]:
    """The ops declared in torch.ops.<namespace>, without the namespace."""
    prefix = namespace + "::"
    names = torch._C._dispatch_get_all_op_names()
    return sorted({n[len(prefix) :].split(".")[0] for n in names if n.startswith(prefix)})


# The checks: each returns the problems it finds, as sentences ---------------------------------


def _written(schema) -> list[str]:
    return [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def twin_problems(schema, twin) -> list[str]:
    """A twin takes every argument of the schema, in order and with its defaults (it writes into
    the outputs like the op), or exactly the arguments the op only reads (it returns the rest)."""
    params = inspect.signature(twin).parameters.values()
    names = [p.name for p in params]
    every = [a.name for a in schema.arguments]
    read = [n for n in every if n not in _written(schema)]
    where = f"{schema.name}: twin {twin.__module__}.{twin.__name__}"
    if names == read:
        return []
    if names != every:
        return [f"{where} takes {names}, not the schema's {every} (or its inputs {read})"]
    want = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    got = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return [] if got == want else [f"{where} has defaults {got}, the schema {want}"]


def _meta(tree):
    return tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t, tree)


def fake_problems(op, args: tuple, kwargs: dict) -> list[str]:
    """The op's fake, run under FakeTensorMode on fakes of (args, kwargs), returns what the op
    returns and leaves every argument the shape and dtype the op leaves it (compared by shape and
    dtype; the arguments are cloned for the real run)."""
    clone = lambda tree: tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)  # noqa: E731
    real_args, real_kwargs = clone(args), clone(kwargs)
    real = op(*real_args, **real_kwargs)
    with FakeTensorMode() as mode:
        to_fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        fake_args, fake_kwargs = tree_map(to_fake, (args, kwargs))
        try:
            fake = op(*fake_args, **fake_kwargs)
        except Exception as exc:  # noqa: BLE001 - the problem is the report
            return [f"{op}: the fake raised {exc!r}"]
    out = []
    if _meta(fake) != _meta(real):
        out.append(f"{op}: the fake returns {_meta(fake)}, the op {_meta(real)}")
    if _meta((fake_args, fake_kwargs)) != _meta((real_args, real_kwargs)):
        out.append(f"{op}: the fake leaves its arguments other than the op does")
    return out


def kernel_problems(qualname: str, cuda: bool) -> list[str]:
    """A fake (the Meta key, where register_fake puts it), a CPU and, with CUDA, a CUDA kernel."""
    keys = {"Meta": "fake", "CPU": "CPU kernel", **({"CUDA": "CUDA kernel"} if cuda else {})}
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [f"{qualname} has no {what}" for key, what in keys.items() if not has(qualname, key)]


def _wrappers() -> dict[str, list[str]]:
    """op -> the functions of graphfp8.ops marked as its wrapper (graphfp8.ops._lib.wraps_op)."""
    found: dict[str, set[str]] = {}
    for info in pkgutil.iter_modules(graphfp8.ops.__path__, "graphfp8.ops."):
        module = __import__(info.name, fromlist=["_"])
        for fn in vars(module).values():
            if callable(fn) and hasattr(fn, "graphfp8_op"):
                found.setdefault(fn.graphfp8_op, set()).add(f"{fn.__module__}.{fn.__qualname__}")
    return {op: sorted(fns) for op, fns in found.items()}


# One real call of every op, through its wrapper -------------------------------------------------


class _FirstCalls(TorchDispatchMode):
    """Records each graphfp8 op's first call, its arguments cloned before the op writes them."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "graphfp8" and func._schema.name not in self.calls:
            clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.calls[func._schema.name] = (func, tree_map(clone, args), tree_map(clone, kwargs))
        return func(*args, **kwargs)


def _call_every_wrapper() -> None:
    """Calls every wrapper of graphfp8.ops once on small CPU tensors."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    one, zero = lambda: torch.ones(1), lambda: torch.zeros(1)  # noqa: E731
    x, dy, gamma, beta = rand(4, 16), rand(4, 16), rand(16), rand(16)
    x_fp8, scale_inv = ops.cast_to_fp8(x, one(), zero(), E4M3)
    ops.cast_transpose(x, one(), zero(), E4M3)
    ops.fp8_transpose(x_fp8)
    b_fp8, b_scale_inv = ops.cast_to_fp8(rand(16, 16), one(), zero(), E4M3)
    ops.fp8_gemm_accumulate_(x_fp8, scale_inv, b_fp8.t(), b_scale_inv, torch.zeros(4, 16))
    bf16_out, alpha_beta = torch.zeros(4, 16, dtype=torch.bfloat16), torch.tensor([1.0, 0.0])
    ops.fp8_gemm_into_(x_fp8, scale_inv, b_fp8.t(), b_scale_inv, bf16_out, alpha_beta)
    ops.dequantize(x_fp8, scale_inv)
    ops.grad_fold_(rand(4, 16), dy, torch.ones(1, dtype=torch.int32))
    ops.amax_(x, zero())
    ops.gelu_amax_(x, zero())
    ops.dgelu_amax_(dy, x, zero())
    ops.cast_transpose_dbias(dy, one(), zero(), E5M2)
    ops.gelu_cast_transpose(x, one(), zero(), E4M3)
    ops.dgelu_cast_transpose_dbias(dy, x, one(), zero(), E5M2)
    ops.glu_cast_transpose(x, "swiglu", one(), zero(), E4M3)
    ops.dglu_cast_transpose_dbias(rand(4, 8), x, "swiglu", one(), zero(), E5M2)
    ops.scale_update_(rand(3, 2).abs(), torch.ones(2), torch.full((2,), 448.0), False)
    ln = ops.layernorm_fp8(x, gamma, beta, 1e-5, one(), zero(), E4M3)
    rms = ops.rmsnorm_fp8(x, gamma, 1e-5, one(), zero(), E4M3)
    ops.layernorm_amax_(x, gamma, beta, 1e-5, zero())
    ops.rmsnorm_amax_(x, gamma, 1e-5, zero())
    ops.layernorm_bwd(dy, x, ln.mu, ln.rsigma, gamma)
    ops.rmsnorm_bwd(dy, x, rms.rsigma, gamma)
    ops.cast_stats(x, one(), one(), E4M3)
    ops.blockwise_quantize(rand(4, 130), 1, E4M3, transpose=True, noop=zero())
    ops.blockwise_norm(
        rand(4, 130), rand(130), rand(130), 1e-5, transpose=True, residual=rand(4, 130)
    )
    ops.blockwise_act(rand(4, 260), "swiglu", transpose=True)
    ops.mlp_act(rand(4, 20), "swiglu")
    ops.mlp_dact(rand(4, 10), rand(4, 20), "swiglu")
    bq, b_inv = ops.blockwise_quantize(rand(4, 130), 1, E4M3)
    ops.blockwise_stats(rand(4, 130), bq, b_inv, 1, one(), torch.zeros(8, 7, dtype=torch.float64))
    qkv, cos, sin = rand(1, 2, 3 * 2 * 4), rand(2, 4), rand(2, 4)  # 2 heads of 4, seq 2
    ops.rope_qkv(qkv, cos, sin, 2)
    parts, part_scale_inv = ops.rope_fp8(qkv, cos, sin, 2, [(one(), zero(), E4M3)] * 3)
    ops.rope_fp8_backward(parts, part_scale_inv, cos, sin, torch.float32)
    grads = [rand(1, 2, 2, 4) for _ in range(3)]
    ops.rope_amax_(grads, cos, sin, 2, zero())
    ops.rope_cast_transpose(grads, cos, sin, 2, (one(), zero(), E5M2), True)
    q, k, v, scales, attn_scale = forward_case((1, 16, 2, 1, 16), E4M3, "cpu")
    o, stats = ops.sdpa_fp8_forward(q, k, v, scales, zero(), zero(), attn_scale)
    d_o, descale_do = quantized(q.shape, E5M2, "cpu", gen)
    bwd = backward_scales(q, k, v, o, d_o, stats, scales, attn_scale, E5M2, descale_do)
    ops.sdpa_fp8_backward(q, k, v, o, d_o, stats, bwd, [zero() for _ in range(4)], attn_scale)


@pytest.fixture(scope="module")
def first_calls():
    with _FirstCalls() as record:
        _call_every_wrapper()
    return record.calls


# The tests ----------------------------------------------------------------------------------------


def test_every_op_is_called_by_the_sample_calls(first_calls):
    missing = sorted(set(op_names()) - {name.split("::")[1] for name in first_calls})
    assert not missing, f"add a call of their wrappers to _call_every_wrapper: {missing}"


@pytest.mark.parametrize("name", op_names())
def test_op_agrees_wherever_it_is_written(name, first_calls):
    qualname = f"graphfp8::{name}"
    op = getattr(torch.ops.graphfp8, name).default
    twin = TWINS.get(name, getattr(reference, name, None))
    problems = kernel_problems(qualname, ops.built_with_cuda())
    problems += twin_problems(op._schema, twin) if twin else [f"{qualname} has no twin"]
    wrappers = _wrappers().get(name, [])
    if len(wrappers) != 1:
        problems.append(f"{qualname} has {len(wrappers)} wrappers (wraps_op): {wrappers}")
    if qualname in first_calls and not problems:
        _, args, kwargs = first_calls[qualname]
        problems += fake_problems(op, args, kwargs)
    assert problems == []


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_every_op_has_a_cuda_kernel():
    """The CUDA suite's share of the walk above: the build on a GPU machine holds every kernel."""
    assert ops.built_with_cuda()
    assert [p for n in op_names() for p in kernel_problems(f"graphfp8::{n}", cuda=True)] == []


# The checks fail where they should: scratch ops with a wrong fake and wrong twins -----------------


def _row_sums(x, out, factor=1.0):
    out.copy_(x * factor)
    return x.sum(dim=1)


@pytest.fixture(scope="module")
def scratch_ops():
    lib = torch.library.Library("graphfp8_selftest", "DEF")
    for name in ("good", "bad"):
        lib.define(f"{name}(Tensor x, Tensor(a!) out, float factor=1.0) -> Tensor")
        lib.impl(name, _row_sums, "CPU")
    fake = torch.library.register_fake
    fake("graphfp8_selftest::good", lib=lib)(lambda x, out, factor=1.0: x.new_empty(x.shape[0]))
    fake("graphfp8_selftest::bad", lib=lib)(lambda x, out, factor=1.0: x.new_empty(x.shape))
    yield torch.ops.graphfp8_selftest
    lib._destroy()


def test_the_checks_catch_a_wrong_fake_and_wrong_twins(scratch_ops):
    args = (torch.randn(3, 4), torch.empty(3, 4))
    assert op_names("graphfp8_selftest") == ["bad", "good"]
    assert kernel_problems("graphfp8_selftest::good", cuda=False) == []
    assert kernel_problems("graphfp8_selftest::good", cuda=True) == [
        "graphfp8_selftest::good has no CUDA kernel"
    ]
    assert fake_problems(scratch_ops.good.default, args, {}) == []
    [problem] = fake_problems(scratch_ops.bad.default, args, {})
    assert "the fake returns ((3, 4), torch.float32), the op ((3,), torch.float32)" in problem

    schema = scratch_ops.good.default._schema
    assert twin_problems(schema, lambda x, out, factor=1.0: None) == []
    assert twin_problems(schema, lambda x, factor=1.0: None) == []  # returns out
    [renamed] = twin_problems(schema, lambda x, dst, factor=1.0: None)
    assert "takes ['x', 'dst', 'factor'], not the schema's ['x', 'out', 'factor']" in renamed
    [default] = twin_problems(schema, lambda x, out, factor=2.0: None)
    assert "has defaults {'factor': 2.0}, the schema {'factor': 1.0}" in default
