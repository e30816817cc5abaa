"""graphfp8.ops.cudnn_sdpa's graph declarations and bindings, checked on the CPU against a fake
cuDNN frontend that records them: every declared operand is bound to a tensor whose memory the
declaration describes (BSHD seen as BHSD through strides), every output names its data type (an
output without one takes the graph's FP8 I/O type), the mask and scale reach the op, graphs are
built once per shape, and unsupported shapes and builds inside a capture fail clearly. (The real
cuDNN runs in the CUDA tests of test_sdpa_fp8.py.)"""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from graphfp8.ops import cudnn_ragged, cudnn_sdpa

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Tensor:
    def __init__(self, **kw):
        self.uid, self.dim, self.stride = kw.get("uid"), kw.get("dim"), kw.get("stride")
        self.data_type, self.output, self.ragged = kw.get("data_type"), False, None

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def set_uid(self, v):
        self.uid = v
        return self

    def set_output(self, v):
        self.output = v
        return self

    def set_dim(self, v):
        self.dim = list(v)
        return self

    def set_stride(self, v):
        self.stride = list(v)
        return self

    def set_data_type(self, v):
        self.data_type = v
        return self


class _Graph:
    built = []

    def __init__(self, **kw):
        self.kw, self.tensors, self.op = kw, [], None
        _Graph.built.append(self)

    def tensor(self, **kw):
        t = _Tensor(**kw)
        self.tensors.append(t)
        return t

    def _outputs(self, name, n, kw):
        self.op = (name, kw)
        outs = [_Tensor() for _ in range(n)]
        self.tensors += outs
        return outs

    def sdpa_fp8(self, **kw):
        return self._outputs("sdpa_fp8", 4, kw)

    def sdpa_fp8_backward(self, **kw):
        return self._outputs("sdpa_fp8_backward", 7, kw)

    def validate(self):
        pass

    build_operation_graph = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def check_support(self):
        if _FAKE.unsupported:
            raise _FAKE.cudnnGraphNotSupportedError("no engine for this graph")

    def get_workspace_size(self):
        return 1024


_FAKE = types.SimpleNamespace(
    pygraph=_Graph,
    data_type=types.SimpleNamespace(
        FLOAT="FLOAT", FP8_E4M3="FP8_E4M3", FP8_E5M2="FP8_E5M2", INT32="INT32"
    ),  # fmt: skip
    heur_mode=types.SimpleNamespace(A="A", FALLBACK="FALLBACK"),
    diagonal_alignment=types.SimpleNamespace(TOP_LEFT="TOP_LEFT"),
    cudnnGraphNotSupportedError=type("cudnnGraphNotSupportedError", (Exception,), {}),
    create_handle=lambda: "handle",
    set_stream=lambda handle, stream: None,
    backend_version_string=lambda: "fake",
    unsupported=False,
)
_DTYPE = {E4M3: "FP8_E4M3", E5M2: "FP8_E5M2", torch.float32: "FLOAT"}


@pytest.fixture
def fake_cudnn(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", _FAKE)
    monkeypatch.setattr(_FAKE, "unsupported", False)
    monkeypatch.setattr(cudnn_sdpa, "_FORWARD", {})
    monkeypatch.setattr(cudnn_sdpa, "_BACKWARD", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    executed = []
    monkeypatch.setattr(
        cudnn_sdpa, "_execute", lambda graph, ws, pack, device: executed.append((graph, ws, pack))
    )
    _Graph.built = []
    return executed


def _check_bindings(graph: _Graph, pack: dict) -> None:
    declared = [t for t in graph.tensors if t.uid is not None]
    assert sorted(t.uid for t in declared) == sorted(pack), "declared and bound uids differ"
    for t in declared:
        bound = pack[t.uid]
        assert t.data_type == _DTYPE[bound.dtype], f"uid {t.uid}: {t.data_type} vs {bound.dtype}"
        view = bound.permute(0, 2, 1, 3) if bound.dim() == 4 and t.dim[-1] != 1 else bound
        if bound.numel() == 1:
            assert t.dim == [1, 1, 1, 1] and t.stride == [1, 1, 1, 1]
        else:
            assert list(view.shape) == t.dim and list(view.stride()) == t.stride, f"uid {t.uid}"
    outputs = [t for t in graph.tensors if t.output]
    assert all(t.data_type is not None for t in outputs)


def _forward_operands(b=2, s=32, h=4, g=2, d=64):
    q = torch.zeros(b, s, h, d, dtype=E4M3)
    k, v = (torch.zeros(b, s, g, d, dtype=E4M3) for _ in "kv")
    scalars = [torch.ones(1) for _ in cudnn_sdpa.FWD_SCALES]
    return q, k, v, scalars, torch.empty_like(q), torch.empty(b, h, s, 1), [torch.zeros(1)] * 2


def test_forward_declarations_match_the_bound_tensors(fake_cudnn):
    q, k, v, scales, o, stats, amax = _forward_operands()
    cudnn_sdpa.forward(q, k, v, scales, o, stats, amax, 0.125, True)
    cudnn_sdpa.forward(q, k, v, scales, o, stats, amax, 0.125, True)
    assert len(_Graph.built) == 1, "one graph per shape, built once"
    graph, workspace, pack = fake_cudnn[-1]
    assert workspace == 1024 and len(fake_cudnn) == 2
    _check_bindings(graph, pack)
    name, kw = graph.op
    assert name == "sdpa_fp8" and kw["attn_scale"] == 0.125 and kw["generate_stats"] is True
    assert kw["diagonal_alignment"] == "TOP_LEFT" and kw["right_bound"] == 0
    for n in cudnn_sdpa.FWD_SCALES:
        assert kw[n].uid is not None and kw[n].data_type == "FLOAT"
    assert graph.kw["io_data_type"] == "FP8_E4M3"


@pytest.mark.parametrize("grad_dtype", [E5M2, E4M3])
def test_backward_declarations_match_the_bound_tensors(fake_cudnn, grad_dtype):
    q, k, v, _, o, stats, _ = _forward_operands()
    d_o = torch.zeros(o.shape, dtype=grad_dtype)
    grads = [torch.empty(t.shape, dtype=grad_dtype) for t in (q, k, v)]
    scales = [torch.ones(1) for _ in cudnn_sdpa.BWD_SCALES]
    cudnn_sdpa.backward(q, k, v, o, d_o, stats, scales, *grads, [torch.zeros(1)] * 4, 0.125, True)
    graph, _, pack = fake_cudnn[-1]
    _check_bindings(graph, pack)
    name, kw = graph.op
    assert name == "sdpa_fp8_backward" and kw["attn_scale"] == 0.125
    assert {"descale_dO", "descale_dP", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"} <= set(kw)


def _backward_args():
    q, k, v, _, o, stats, _ = _forward_operands()
    d_o = torch.zeros(o.shape, dtype=E5M2)
    grads = [torch.empty(t.shape, dtype=E5M2) for t in (q, k, v)]
    scales = [torch.ones(1) for _ in cudnn_sdpa.BWD_SCALES]
    return (q, k, v, o, d_o, stats, scales, *grads, [torch.zeros(1)] * 4, 0.125, True)


@contextlib.contextmanager
def _deterministic_algorithms(warn_only: bool):
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_deterministic_algorithms_refuse_the_backward(fake_cudnn):
    """Under torch.use_deterministic_algorithms(True) the backward raises before a graph is built
    or run (cuDNN's FP8 attention differed run to run on the H200 with its deterministic graph:
    graphfp8.ops.cudnn_determinism); it used to build and run that graph. A forward still runs."""
    args = _backward_args()
    cudnn_sdpa.backward(*args)
    with _deterministic_algorithms(warn_only=False):
        with pytest.raises(RuntimeError, match="different bits run to run on the H200"):
            cudnn_sdpa.backward(*args)
        q, k, v, scales, o, stats, amax = _forward_operands()
        cudnn_sdpa.forward(q, k, v, scales, o, stats, amax, 0.125, True)
    assert [g.op[0] for g in _Graph.built] == ["sdpa_fp8", "sdpa_fp8_backward"]
    assert not any(key.deterministic for key in cudnn_sdpa._BACKWARD)
    assert len(fake_cudnn) == 2  # the first backward and the forward


def test_warn_only_builds_the_deterministic_backward(fake_cudnn):
    """Under warn_only the backward warns, then builds cuDNN's deterministic graph (its own
    cached key; the forward graph is shared) and runs it."""
    args = _backward_args()
    cudnn_sdpa.backward(*args)
    with _deterministic_algorithms(warn_only=True):
        with pytest.warns(UserWarning, match="not deterministic"):
            cudnn_sdpa.backward(*args)
        cudnn_sdpa.backward(*args)
    names = [g.op[0] for g in _Graph.built]
    assert names == ["sdpa_fp8", "sdpa_fp8_backward", "sdpa_fp8_backward"]
    bwd = _Graph.built[1:]
    assert [g.op[1]["use_deterministic_algorithm"] for g in bwd] == [False, True]
    assert [call[0] for call in fake_cudnn] == [bwd[0], bwd[1], bwd[1]]


def test_ragged_declarations_with_segments(fake_cudnn):
    """With segment ids the graphs are ragged (graphfp8.ops.cudnn_ragged): one sequence slot per
    run of a row, BSHD strides, each operand displaced by its ragged offset, the padding mask on
    the slots' lengths, (token, head)-major statistics; the pack binds the layout's values."""
    q, k, v, scales, o, stats, amax = _forward_operands()  # b 2, s 32, h 4, g 2, d 64
    seg = torch.tensor([[0] * 10 + [1] * 22, [5] * 32])
    cudnn_sdpa.forward(q, k, v, scales, o, stats, amax, 0.125, True, seg)
    graph, _, pack = fake_cudnn[-1]
    n = cudnn_ragged.slots(2)
    by_uid = {t.uid: t for t in graph.tensors if t.uid is not None}
    assert sorted(by_uid) == sorted(pack), "declared and bound uids differ"
    first = int(cudnn_sdpa._Uid.RAGGED)
    seq_len, off_q, off_kv, off_stats = (by_uid[first + i] for i in range(4))
    assert seq_len.dim == [n, 1, 1, 1] and off_q.dim == [n + 1, 1, 1, 1]
    assert all(t.data_type == "INT32" for t in (seq_len, off_q, off_kv, off_stats))
    decl = {u: by_uid[int(u)] for u in (cudnn_sdpa._Uid.Q, cudnn_sdpa._Uid.K, cudnn_sdpa._Uid.O,
                                        cudnn_sdpa._Uid.STATS)}  # fmt: skip
    assert decl[cudnn_sdpa._Uid.Q].dim == [n, 4, 32, 64]
    assert decl[cudnn_sdpa._Uid.Q].stride == [32 * 4 * 64, 64, 4 * 64, 1]
    assert decl[cudnn_sdpa._Uid.Q].ragged is off_q and decl[cudnn_sdpa._Uid.O].ragged is off_q
    assert decl[cudnn_sdpa._Uid.K].ragged is off_kv and decl[cudnn_sdpa._Uid.K].dim[1] == 2
    assert decl[cudnn_sdpa._Uid.STATS].stride == [4 * 32, 1, 4, 1]
    assert decl[cudnn_sdpa._Uid.STATS].ragged is off_stats
    _, kw = graph.op
    assert kw["use_padding_mask"] is True and kw["seq_len_q"] is seq_len
    lengths = pack[first].flatten().tolist()
    assert lengths[:3] == [10, 22, 0] and lengths[16:18] == [32, 0] and sum(lengths) == 64
    assert pack[first + 1].flatten()[:3].tolist() == [0, 10 * 256, 32 * 256]
    assert pack[first + 2].flatten()[1].item() == 10 * 128
    assert pack[first + 3].flatten()[1].item() == 10 * 4


def test_more_runs_than_slots_merge_into_the_last():
    seg = torch.arange(40).repeat_interleave(2)[None]  # 40 runs of 2 tokens in one row
    lengths = cudnn_ragged.layout(seg, 2, 1, 16)["seq_len"].flatten().tolist()
    assert lengths[:15] == [2] * 15 and lengths[15] == 80 - 30


def test_unsupported_shape_raises_value_error(fake_cudnn):
    _FAKE.unsupported = True
    q, k, v, scales, o, stats, amax = _forward_operands()
    declined = r"cuDNN does not support FP8 attention \(forward\) for batch=2"
    with pytest.raises(ValueError, match=declined):
        cudnn_sdpa.forward(q, k, v, scales, o, stats, amax, 0.125, True)
    assert not fake_cudnn


def test_no_graph_is_built_inside_a_capture(fake_cudnn, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    q, k, v, scales, o, stats, amax = _forward_operands()
    with pytest.raises(RuntimeError, match="cannot be built inside a CUDA-graph capture"):
        cudnn_sdpa.forward(q, k, v, scales, o, stats, amax, 0.125, True)
    assert not _Graph.built
