"""The FP8 attention ops (CPU emulation; cuDNN on the GPU) against their float64 twin: outputs,
stats, every gradient and every amax; bad input; the missing optional dependency. The CUDA
cases print what they measure (SQNR, errors, amaxes with their bits), so that one GPU run tells
what is wrong.

Floors compare FP8 codes with the twin's FP8 codes (dequantized): the CPU emulation computes the
twin's math in float32, so they differ only where a float32 value rounds to another FP8 code.
cuDNN quantizes P against a running maximum, tile by tile, so its codes differ more often; its
floors come from the first GPU run (H200, cuDNN 9.19, cudnn-frontend 1.32; numbers below).
"""

from __future__ import annotations

import sys

import pytest
import torch

from graphfp8 import ops, reference_attention
from graphfp8.ops import cudnn_sdpa
from tests.helpers import CUDA_PARAM
from tests.ops.attention_data import (
    SHAPES,
    amax_report,
    backward_scales,
    check_amax,
    forward_case,
    quantized,
    report,
)

FORMATS = [
    (torch.float8_e4m3fn, torch.float8_e5m2),  # HYBRID
    (torch.float8_e4m3fn, torch.float8_e4m3fn),  # E4M3
]
# dB floors of the op against the twin (FP8 codes): (forward O, gradients), per device. CUDA
# measured O 38.4-44.3 dB and dQ, dK, dV 36.0-40.7 dB over these shapes and formats.
FLOORS = {"cpu": (40.0, 30.0), "cuda": (35.0, 33.0)}


def _devices_and_shapes():
    out = [pytest.param("cpu", s, id=f"cpu-{'x'.join(map(str, s))}") for s in SHAPES["cpu"]]
    for s in SHAPES["cuda"]:
        out.append(
            pytest.param("cuda", s, id=f"cuda-{'x'.join(map(str, s))}", marks=CUDA_PARAM.marks)
        )
    return out


def _run_forward(shape, fwd_dtype, device):
    q, k, v, scales, attn_scale = forward_case(shape, fwd_dtype, device)
    amax_s, amax_o = torch.zeros(1, device=device), torch.zeros(1, device=device)
    o, stats = ops.sdpa_fp8_forward(q, k, v, scales, amax_s, amax_o, attn_scale)
    want = reference_attention.sdpa_fp8_forward(q, k, v, scales, attn_scale)
    return (q, k, v, scales, attn_scale), (o, stats, amax_s, amax_o), want


@pytest.mark.parametrize("device, shape", _devices_and_shapes())
@pytest.mark.parametrize("fwd_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_forward_matches_twin(device, shape, fwd_dtype):
    (_, _, _, scales, _), (o, stats, amax_s, amax_o), want = _run_forward(shape, fwd_dtype, device)
    print(f"\nforward {shape} {fwd_dtype}")
    o_db = report("O (FP8 codes vs the twin's)", want["o"].float(), o.float())
    report("O vs the twin's unquantized O", want["o_hp"], o.float() / scales["scale_o"])
    stats_db = report("stats", want["stats"], stats)
    amax_report("amax_S", want["amax_s"], amax_s)
    amax_report("amax_O", want["amax_o"], amax_o)
    assert o.dtype == fwd_dtype and o.shape == want["o"].shape
    assert o_db >= FLOORS[device][0], f"O SQNR {o_db:.2f} dB"
    assert stats_db >= 60.0, f"stats SQNR {stats_db:.2f} dB"
    for name, got in (("amax_s", amax_s), ("amax_o", amax_o)):
        check_amax(name, want[name], got, device)


def _hopper_rejects_backward(device, head_dim: int) -> bool:
    """cuDNN's FP8 attention backward takes head_dim 128 only on Hopper (sm_90; 9.19 says
    "hidden_dim shoud be equal to 128"); the forward takes 64 too."""
    return device == "cuda" and head_dim != 128 and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("device, shape", _devices_and_shapes())
@pytest.mark.parametrize("fwd_dtype, bwd_dtype", FORMATS)
def test_backward_matches_twin(device, shape, fwd_dtype, bwd_dtype):
    (q, k, v, fwd_scales, attn_scale), (o, stats, _, _), _ = _run_forward(shape, fwd_dtype, device)
    gen = torch.Generator().manual_seed(7)
    d_o, descale_do = quantized(o.shape, bwd_dtype, device, gen)
    scales = backward_scales(q, k, v, o, d_o, stats, fwd_scales, attn_scale, bwd_dtype, descale_do)
    amaxes = [torch.zeros(1, device=device) for _ in range(4)]
    if _hopper_rejects_backward(device, shape[-1]):
        with pytest.raises(ValueError, match=r"FP8 attention \(backward\).*hidden_dim") as info:
            ops.sdpa_fp8_backward(q, k, v, o, d_o, stats, scales, amaxes, attn_scale)
        print(f"\nbackward {shape}: raises as expected on Hopper: {info.value}")
        assert all(a.item() == 0.0 for a in amaxes)  # raised before anything ran
        return
    grads = ops.sdpa_fp8_backward(q, k, v, o, d_o, stats, scales, amaxes, attn_scale)
    want = reference_attention.sdpa_fp8_backward(q, k, v, o, d_o, stats, scales, attn_scale)
    print(f"\nbackward {shape} {fwd_dtype} {bwd_dtype}")
    floor = FLOORS[device][1]
    for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
        assert got.dtype == bwd_dtype and got.shape == want[name].shape, name
        db = report(f"{name} (FP8 codes)", want[name].float(), got.float())
        report(f"{name} vs unquantized", want[f"{name}_hp"], got.float() / scales[f"scale_{name}"])
        assert db >= floor, f"{name} SQNR {db:.2f} dB"
    print(
        f"twin max |dO V^T| = {float(want['max_abs_dp']):.6g} (if amax_dP matches this, the "
        "kernel reports the unscaled dP, not dS)"
    )
    for name, got in zip(("dp", "dq", "dk", "dv"), amaxes, strict=True):
        amax_report(f"amax_{name}", want[f"amax_{name}"], got)
    for name, got in zip(("dp", "dq", "dk", "dv"), amaxes, strict=True):
        check_amax(f"amax_{name}", want[f"amax_{name}"], got, device)


@pytest.mark.parametrize("device", ["cpu", CUDA_PARAM])
def test_amax_outputs_fold_into_the_slots(device):
    """A slot that already holds a larger amax keeps it (max fold, as the casts do); a smaller
    one is raised to the call's amax. cuDNN writes its amaxes into the slots: this prints
    whether it folds or overwrites (either is correct for graphfp8, whose slots see one writer
    per step after the scale update zeroed them), and fails on anything else."""
    shape = SHAPES[device][0]
    q, k, v, scales, attn_scale = forward_case(shape, torch.float8_e4m3fn, device)
    want = reference_attention.sdpa_fp8_forward(q, k, v, scales, attn_scale)
    big = torch.full((1,), 1e6, device=device)
    small = torch.full((1,), 1e-6, device=device)
    ops.sdpa_fp8_forward(q, k, v, scales, big, small, attn_scale)
    print(
        f"\namax_S slot holding 1e6 -> {big.item():.6g}; amax_O slot holding 1e-6 -> "
        f"{small.item():.6g} (twin amax_O {float(want['amax_o']):.6g})"
    )
    if device == "cpu":
        assert big.item() == 1e6
    else:
        assert big.item() in (1e6, pytest.approx(float(want["amax_s"]), rel=5e-2))
    check_amax("amax_O", want["amax_o"], small, device)


@pytest.mark.parametrize(
    "shape, causal, match",
    [
        ((2, 16, 2, 2, 8), True, "head_dim a multiple of 16"),
        ((2, 16, 2, 2, 24), True, "head_dim a multiple of 16"),
        ((2, 16, 2, 2, 144), True, "at most 128"),
        ((2, 16, 3, 2, 16), True, "multiple of kv_heads"),
        ((2, 16, 2, 2, 16), False, "causal mask only"),
    ],
)
def test_unsupported_shapes_raise_before_running(shape, causal, match):
    b, s, h, g, d = shape
    q = torch.zeros(b, s, h, d, dtype=torch.float8_e4m3fn)
    kv = torch.zeros(b, s, g, d, dtype=torch.float8_e4m3fn)
    one = torch.ones(1)
    scales = {n: one for n in cudnn_sdpa.FWD_SCALES}
    amax = torch.zeros(1)
    with pytest.raises(ValueError, match=match):
        ops.sdpa_fp8_forward(q, kv, kv, scales, amax, amax, 0.25, causal=causal)
    assert amax.item() == 0.0


def test_wrong_layout_and_dtypes_raise():
    one = torch.ones(1)
    scales = {n: one for n in cudnn_sdpa.FWD_SCALES}
    amax = torch.zeros(1)
    q = torch.zeros(2, 16, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="share batch, sequence length"):
        ops.sdpa_fp8_forward(q, q[:, :8], q[:, :8], scales, amax, amax, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        t = q.transpose(1, 2).contiguous().transpose(1, 2)  # BHSD memory seen as BSHD
        ops.sdpa_fp8_forward(t, t, t, scales, amax, amax, 0.25)
    with pytest.raises(TypeError, match="FP8 of one dtype"):
        ops.sdpa_fp8_forward(q, q.to(torch.float8_e5m2), q, scales, amax, amax, 0.25)
    with pytest.raises(ValueError, match=r"expected q \(batch, seq, heads, head_dim\)"):
        ops.sdpa_fp8_forward(q[0], q[0], q[0], scales, amax, amax, 0.25)


def test_missing_cudnn_frontend_names_the_extra(monkeypatch):
    """On a GPU without nvidia-cudnn-frontend the error says how to install it."""
    monkeypatch.setitem(sys.modules, "cudnn", None)
    with pytest.raises(ImportError, match=r"pip install -e \.\[attention\]"):
        cudnn_sdpa.cudnn_module()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_equals_eager():
    """The cuDNN forward and backward captured in a CUDA graph replay exactly what eager gives,
    with the scales read from device memory at replay time."""
    device = "cuda"
    shape = SHAPES[device][0]
    q, k, v, scales, attn_scale = forward_case(shape, torch.float8_e4m3fn, device)
    amax = [torch.zeros(1, device=device) for _ in range(2)]
    o_eager, stats_eager = ops.sdpa_fp8_forward(q, k, v, scales, *amax, attn_scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.sdpa_fp8_forward(q, k, v, scales, *amax, attn_scale)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        o_graph, stats_graph = ops.sdpa_fp8_forward(q, k, v, scales, *amax, attn_scale)
    scales["scale_o"].mul_(0.5)  # a new scale reaches the replay through device memory
    graph.replay()
    torch.cuda.synchronize()
    o_half, _ = ops.sdpa_fp8_forward(q, k, v, scales, *amax, attn_scale)
    assert torch.equal(stats_graph, stats_eager)
    assert torch.equal(o_graph.view(torch.uint8), o_half.view(torch.uint8))
    assert not torch.equal(o_graph.view(torch.uint8), o_eager.view(torch.uint8))


def test_a_declined_backward_names_the_pass_and_the_way_out():
    """cuDNN 9.19 builds the FP8 forward for head_dim 64 on Hopper but declines the backward:
    the error says which pass, the shape, and what runs instead (a fake cudnn module here)."""

    class Declined(Exception):
        pass

    class FakeCudnn:
        cudnnGraphNotSupportedError = Declined

        @staticmethod
        def backend_version_string():
            return "9.19.0"

    def build(cudnn, key):
        raise Declined("hidden_dim shoud be equal to 128")

    key = cudnn_sdpa.SdpaKey(0, 1, 128, 2, 2, 64, torch.float8_e4m3fn, torch.float8_e5m2,
                             0.125, True)  # fmt: skip
    with pytest.raises(ValueError, match=r"\(backward\) for batch=1, seq=128.*head_dim=64") as e:
        cudnn_sdpa._build_or_explain(FakeCudnn, key, "backward", build)
    assert "run without gradients" in str(e.value) and "hidden_dim shoud be" in str(e.value)
    with pytest.raises(ValueError, match=r"\(forward\)") as e:
        cudnn_sdpa._build_or_explain(FakeCudnn, key, "forward", build)
    assert "run without gradients" not in str(e.value)
