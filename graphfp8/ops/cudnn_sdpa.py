"""The GPU side of graphfp8.ops.sdpa_fp8: cuDNN's FP8 attention through the cuDNN frontend
(`nvidia-cudnn-frontend`, the optional extra `graphfp8[attention]`, imported only here).

One forward and one backward cuDNN graph per (device, shape, FP8 dtypes, attn_scale, mask), built
on first use (`prepare`, which graphfp8 calls before any kernel of an attention runs, so an
unsupported shape raises first and nothing is built inside a CUDA-graph capture) and cached.
Executing one is a host-only call that enqueues cuDNN's kernels on the current stream with
pointers to the given tensors; every scale, descale and amax is a device tensor, so a CUDA graph
that captures the call replays it with whatever the arenas hold, and the amax outputs are the
arena's own H[0] slots (cuDNN folds into them; nothing else writes them during a step).

Tensors are declared as cuDNN wants them: Q, K, V, O, dO, dQ, dK, dV with dims (batch, heads,
seq, head_dim) over BSHD memory (strides (seq * heads * d, d, heads * d, 1)); stats (batch,
heads, seq, 1) float32; every scalar and every amax (1, 1, 1, 1) float32. An output declared
without a data type takes the graph's FP8 I/O type, so each one names its type. With segment ids
(packed documents, padding) the graphs are ragged: graphfp8.ops.cudnn_ragged has the layout.
Under torch.use_deterministic_algorithms(True) a backward raises before anything is built or
runs: with cuDNN's deterministic backward graph asked for, training runs still gave different
bits run to run on the H200 (docs/fp8.md); under warn_only it warns and builds that graph. A
forward alone runs (no order-dependent sums: its amaxes are maxima).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

from graphfp8 import global_state
from graphfp8.ops import cudnn_ragged
from graphfp8.ops.cudnn_determinism import check_deterministic

__all__ = ["BWD_SCALES", "FWD_SCALES", "SdpaKey", "backward", "cudnn_module", "forward", "prepare"]

# The order of the sdpa_fp8 ops' `scales` lists.
FWD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BWD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s",
              "descale_dp", "scale_s", "scale_dp", "scale_dq", "scale_dk", "scale_dv")  # fmt: skip

INSTALL_HINT = (
    "FP8 attention on the GPU runs cuDNN's FP8 attention through the optional dependency "
    "nvidia-cudnn-frontend: install it with `pip install -e .[attention]` (from the graphfp8 "
    "repository) or `pip install nvidia-cudnn-frontend`"
)


def cudnn_module():
    """The cuDNN frontend's Python module; a clear ImportError naming the extra without it."""
    try:
        import cudnn
    except ImportError as exc:
        raise ImportError(f"graphfp8: {INSTALL_HINT} ({exc})") from exc
    return cudnn


class _Uid(enum.IntEnum):
    Q = 1
    K = 2
    V = 3
    O = 4  # noqa: E741
    STATS = 5
    DO = 6
    DQ = 7
    DK = 8
    DV = 9
    AMAX_S = 10
    AMAX_O = 11
    AMAX_DP = 12
    AMAX_DQ = 13
    AMAX_DK = 14
    AMAX_DV = 15
    RAGGED = 16  # the first of cudnn_ragged's tensors, in its RAGGED_NAMES order
    SCALES = 32  # the first of the scalar inputs, in FWD_SCALES / BWD_SCALES order


class SdpaKey(NamedTuple):
    """What a cached cuDNN graph is built for (bwd_dtype None for a forward graph). A tuple:
    building and hashing one is part of every call."""

    device: int
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype | None
    attn_scale: float
    causal: bool
    segments: bool = False  # segment ids: a ragged graph (cudnn_ragged)
    # the backward's deterministic algorithm (torch.are_deterministic_algorithms_enabled() when
    # the graph is built or called); False in every forward key
    deterministic: bool = False

    @property
    def graph_batch(self) -> int:
        """The graph's batch dimension: rows, or the sequence slots of a ragged graph."""
        return cudnn_ragged.slots(self.batch) if self.segments else self.batch


# Built graphs and their workspace sizes: forward ones by key with bwd_dtype None.
_FORWARD: dict[SdpaKey, tuple[object, int]] = {}
_BACKWARD: dict[SdpaKey, tuple[object, int]] = {}
_HANDLES: dict[int, object] = {}
# The stream each handle was last set to, per device: set_stream only when it changes.
_HANDLE_STREAM: dict[int, int] = {}
_CACHES = (_FORWARD, _BACKWARD, _HANDLES, _HANDLE_STREAM)


def _clear_caches() -> None:
    for cache in _CACHES:
        cache.clear()


global_state.register("cuDNN SDPA graphs and handles (ops/cudnn_sdpa.py)", _clear_caches,
                      lambda: not any(_CACHES), layer=global_state.BASE)  # fmt: skip


def _handle(device: int):
    handle = _HANDLES.get(device)
    if handle is None:
        with torch.cuda.device(device):
            handle = cudnn_module().create_handle()
        _HANDLES[device] = handle
    return handle


def _fp8_type(cudnn, dtype: torch.dtype):
    return {
        torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3,
        torch.float8_e5m2: cudnn.data_type.FP8_E5M2,
    }[dtype]


def _bshd(batch: int, seq: int, heads: int, head_dim: int) -> tuple[list[int], list[int]]:
    """(dims, strides) of a (batch, seq, heads, head_dim) contiguous tensor seen as BHSD."""
    return [batch, heads, seq, head_dim], [seq * heads * head_dim, head_dim, heads * head_dim, 1]


def _new_graph(cudnn, key: SdpaKey, io_type):
    return cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(key.device),
        is_cuda_graph_replay_expected=True,
    )


def _scalars(cudnn, graph, names) -> dict:
    one = [1, 1, 1, 1]
    return {
        name: graph.tensor(
            uid=int(_Uid.SCALES) + i,
            dim=one,
            stride=one,
            data_type=cudnn.data_type.FLOAT,
            name=name,
        )
        for i, name in enumerate(names)
    }


def _output(cudnn, t, uid: _Uid, dims, strides, dtype) -> None:
    t.set_uid(int(uid)).set_output(True).set_dim(dims).set_stride(strides).set_data_type(dtype)


def _mask_kwargs(cudnn, key: SdpaKey) -> dict:
    if not key.causal:
        return {}
    return dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, right_bound=0)


def _inputs(cudnn, graph, key: SdpaKey, io_type, names, ragged=None):
    """The Q, K, V (and with `names` more, O and dO) tensor declarations; ragged: cudnn_ragged's
    declarations, whose offsets displace each sequence."""
    b, s, d = key.graph_batch, key.seq, key.head_dim
    shapes = {"q": key.heads, "k": key.kv_heads, "v": key.kv_heads, "o": key.heads}
    uids = {"q": _Uid.Q, "k": _Uid.K, "v": _Uid.V, "o": _Uid.O}
    out = {}
    for name in names:
        dims, strides = _bshd(b, s, shapes.get(name, key.heads), d)
        dtype = _fp8_type(cudnn, key.bwd_dtype) if name == "d_o" else io_type
        uid = _Uid.DO if name == "d_o" else uids[name]
        out[name] = graph.tensor(uid=int(uid), dim=dims, stride=strides, data_type=dtype, name=name)
        if ragged is not None:
            out[name].set_ragged_offset(ragged["offset_kv" if name in "kv" else "offset_q"])
    return out


def _build(graph) -> int:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn_module().heur_mode.A, cudnn_module().heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return int(graph.get_workspace_size())


def _build_forward(cudnn, key: SdpaKey):
    io_type = _fp8_type(cudnn, key.fwd_dtype)
    graph = _new_graph(cudnn, key, io_type)
    ragged, padding = cudnn_ragged.declare(cudnn, graph, key, int(_Uid.RAGGED))
    t = _inputs(cudnn, graph, key, io_type, ("q", "k", "v"), ragged)
    sc = _scalars(cudnn, graph, FWD_SCALES)
    o, stats, amax_s, amax_o = graph.sdpa_fp8(
        q=t["q"],
        k=t["k"],
        v=t["v"],
        descale_q=sc["descale_q"],
        descale_k=sc["descale_k"],
        descale_v=sc["descale_v"],
        descale_s=sc["descale_s"],
        scale_s=sc["scale_s"],
        scale_o=sc["scale_o"],
        generate_stats=True,
        attn_scale=key.attn_scale,
        name="sdpa_fp8",
        **_mask_kwargs(cudnn, key),
        **padding,
    )
    b, s, h = key.graph_batch, key.seq, key.heads
    one, f32 = [1, 1, 1, 1], cudnn.data_type.FLOAT
    _output(cudnn, o, _Uid.O, *_bshd(b, s, h, key.head_dim), io_type)
    _output(cudnn, stats, _Uid.STATS, *cudnn_ragged.stats_desc(key.graph_batch, s, h, ragged), f32)
    if ragged is not None:
        o.set_ragged_offset(ragged["offset_q"])
        stats.set_ragged_offset(ragged["offset_stats"])
    _output(cudnn, amax_s, _Uid.AMAX_S, one, one, f32)
    _output(cudnn, amax_o, _Uid.AMAX_O, one, one, f32)
    return graph, _build(graph)


def _build_backward(cudnn, key: SdpaKey):
    io_type = _fp8_type(cudnn, key.fwd_dtype)
    grad_type = _fp8_type(cudnn, key.bwd_dtype)
    graph = _new_graph(cudnn, key, io_type)
    ragged, padding = cudnn_ragged.declare(cudnn, graph, key, int(_Uid.RAGGED))
    t = _inputs(cudnn, graph, key, io_type, ("q", "k", "v", "o", "d_o"), ragged)
    b, s, h, d = key.graph_batch, key.seq, key.heads, key.head_dim
    one, f32 = [1, 1, 1, 1], cudnn.data_type.FLOAT
    dims, strides = cudnn_ragged.stats_desc(b, s, h, ragged)
    stats = graph.tensor(uid=int(_Uid.STATS), dim=dims, stride=strides, data_type=f32,
                         name="stats")  # fmt: skip
    if ragged is not None:
        stats.set_ragged_offset(ragged["offset_stats"])
    sc = _scalars(cudnn, graph, BWD_SCALES)
    d_q, d_k, d_v, amax_dq, amax_dk, amax_dv, amax_dp = graph.sdpa_fp8_backward(
        q=t["q"],
        k=t["k"],
        v=t["v"],
        o=t["o"],
        dO=t["d_o"],
        stats=stats,
        descale_q=sc["descale_q"],
        descale_k=sc["descale_k"],
        descale_v=sc["descale_v"],
        descale_o=sc["descale_o"],
        descale_dO=sc["descale_do"],
        descale_s=sc["descale_s"],
        descale_dP=sc["descale_dp"],
        scale_s=sc["scale_s"],
        scale_dQ=sc["scale_dq"],
        scale_dK=sc["scale_dk"],
        scale_dV=sc["scale_dv"],
        scale_dP=sc["scale_dp"],
        attn_scale=key.attn_scale,
        use_deterministic_algorithm=key.deterministic,
        name="sdpa_fp8_backward",
        **_mask_kwargs(cudnn, key),
        **padding,
    )
    _output(cudnn, d_q, _Uid.DQ, *_bshd(b, s, h, d), grad_type)
    _output(cudnn, d_k, _Uid.DK, *_bshd(b, s, key.kv_heads, d), grad_type)
    _output(cudnn, d_v, _Uid.DV, *_bshd(b, s, key.kv_heads, d), grad_type)
    if ragged is not None:
        d_q.set_ragged_offset(ragged["offset_q"])
        d_k.set_ragged_offset(ragged["offset_kv"])
        d_v.set_ragged_offset(ragged["offset_kv"])
    for amax, uid in (
        (amax_dp, _Uid.AMAX_DP),
        (amax_dq, _Uid.AMAX_DQ),
        (amax_dk, _Uid.AMAX_DK),
        (amax_dv, _Uid.AMAX_DV),
    ):
        _output(cudnn, amax, uid, one, one, f32)
    return graph, _build(graph)


def prepare(key: SdpaKey, backward: bool) -> None:
    """Builds (once) the forward graph of `key`, and its backward graph (for key.bwd_dtype)
    when `backward`; raises ValueError with cuDNN's reason when cuDNN does not support the
    shape, and RuntimeError when a graph would have to be built inside a CUDA-graph capture or
    a deterministic backward is asked for (graphfp8.ops.cudnn_determinism)."""
    check_deterministic(key, backward)
    fwd_key = key._replace(bwd_dtype=None, deterministic=False)
    need_fwd, need_bwd = fwd_key not in _FORWARD, backward and key not in _BACKWARD
    if not (need_fwd or need_bwd):
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"graphfp8: the cuDNN FP8 attention graph for {key} is not built and cannot be built "
            "inside a CUDA-graph capture: run the call once before capturing it (graphfp8's "
            "layers and make_graphed_callables' warmup do)"
        )
    cudnn = cudnn_module()
    with torch.cuda.device(key.device):
        if need_fwd:
            _FORWARD[fwd_key] = _build_or_explain(cudnn, key, "forward", _build_forward)
        if need_bwd:
            _BACKWARD[key] = _build_or_explain(cudnn, key, "backward", _build_backward)


def _build_or_explain(cudnn, key: SdpaKey, which: str, build):
    """build(cudnn, key), or ValueError naming the pass and cuDNN's reason when it declines."""
    try:
        return build(cudnn, key)
    except cudnn.cudnnGraphNotSupportedError as exc:
        hint = (
            " (the forward is supported: run without gradients, or with a head_dim cuDNN's "
            "backward takes: 128 on Hopper)"
            if which == "backward"
            else ""
        )
        raise ValueError(
            f"graphfp8: cuDNN does not support FP8 attention ({which}) for batch={key.batch}, "
            f"seq={key.seq}, heads={key.heads}, kv_heads={key.kv_heads}, "
            f"head_dim={key.head_dim}, causal={key.causal}, segments={key.segments}, "
            f"deterministic={key.deterministic} on this GPU and cuDNN "
            f"{cudnn.backend_version_string()}{hint}: {exc}"
        ) from exc


def key_for(q: torch.Tensor, k: torch.Tensor, bwd_dtype, attn_scale, causal,
            segments: bool = False) -> SdpaKey:  # fmt: skip
    """The key of a call on q (batch, seq, heads, d) and k (batch, seq, kv_heads, d); a backward
    key (bwd_dtype given) is deterministic while torch's deterministic algorithms are on."""
    b, s, h, d = q.shape
    det = bwd_dtype is not None and torch.are_deterministic_algorithms_enabled()
    return SdpaKey(q.device.index, b, s, h, k.shape[2], d, q.dtype, bwd_dtype, float(attn_scale),
                   bool(causal), segments, det)  # fmt: skip


# The variant packs' uids as plain ints, in the order the ops pass their tensors (no enum
# lookups per call): forward q, k, v, o, stats, amax_S, amax_O, then FWD_SCALES; backward q, k,
# v, o, dO, stats, dQ, dK, dV, amax_dP, dQ, dK, dV, then BWD_SCALES.
_FWD_UIDS = [
    *(int(u) for u in (_Uid.Q, _Uid.K, _Uid.V, _Uid.O, _Uid.STATS, _Uid.AMAX_S, _Uid.AMAX_O)),
    *range(int(_Uid.SCALES), int(_Uid.SCALES) + len(FWD_SCALES)),
]
_BWD_UIDS = [
    *(int(u) for u in (_Uid.Q, _Uid.K, _Uid.V, _Uid.O, _Uid.DO, _Uid.STATS, _Uid.DQ, _Uid.DK)),
    *(int(u) for u in (_Uid.DV, _Uid.AMAX_DP, _Uid.AMAX_DQ, _Uid.AMAX_DK, _Uid.AMAX_DV)),
    *range(int(_Uid.SCALES), int(_Uid.SCALES) + len(BWD_SCALES)),
]


def _execute(graph, workspace_bytes: int, pack: dict, device) -> None:
    """Enqueues a built graph with its variant pack (uid -> tensor) on the current stream. Per
    call only what must be: the workspace (from the caching allocator; a graph capture keeps
    it), and set_stream when the stream changed since the last call on this device."""
    index = device.index
    handle = _HANDLES[index]
    stream = torch._C._cuda_getCurrentRawStream(index)  # no Stream object per call
    if _HANDLE_STREAM.get(index) != stream:
        cudnn_module().set_stream(handle, stream)
        _HANDLE_STREAM[index] = stream
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=device)
    graph.execute(pack, workspace, handle=handle)


def forward(q, k, v, scales, o, stats, amax, attn_scale, causal, segment_ids=None) -> None:
    """torch.ops.graphfp8.sdpa_fp8_fwd on CUDA (graphfp8.ops.sdpa_fp8 has the contract)."""
    key = key_for(q, k, None, attn_scale, causal, segment_ids is not None)
    built = _FORWARD.get(key)
    if built is None:  # a direct op call: build now (graphfp8's layers prepare first)
        prepare(key, backward=False)
        built = _FORWARD[key]
    tensors = [q, k, v, o, stats, amax[0], amax[1], *scales]
    pack = dict(zip(_FWD_UIDS, tensors, strict=True)) | cudnn_ragged.pack(
        segment_ids, q, k, int(_Uid.RAGGED)
    )
    _execute(built[0], built[1], pack, q.device)


def backward(q, k, v, o, d_o, stats, scales, dq, dk, dv, amax, attn_scale, causal,
             segment_ids=None) -> None:  # fmt: skip
    """torch.ops.graphfp8.sdpa_fp8_bwd on CUDA (graphfp8.ops.sdpa_fp8 has the contract)."""
    key = key_for(q, k, d_o.dtype, attn_scale, causal, segment_ids is not None)
    built = _BACKWARD.get(key)
    if built is None:
        prepare(key, backward=True)
        built = _BACKWARD[key]
    tensors = [q, k, v, o, d_o, stats, dq, dk, dv, *amax, *scales]
    pack = dict(zip(_BWD_UIDS, tensors, strict=True)) | cudnn_ragged.pack(
        segment_ids, q, k, int(_Uid.RAGGED)
    )
    _execute(built[0], built[1], pack, q.device)
