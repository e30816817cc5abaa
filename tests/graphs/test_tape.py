"""The replay tape (CPU) and the capture checks (both backends): syncs are caught and named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.graphs import RecordingMode, ReplayTape
from tests.helpers import HAS_CUDA


class ItemInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # the offending line
            y = y * 2
        return y


class MaskInForward(nn.Module):
    def forward(self, x):
        return x[x > 0].sum() * x


class HostCopyInForward(nn.Module):
    def forward(self, x):
        return x * float(x.max().cpu())


def test_item_inside_capture_is_caught_and_named(device):
    m = ItemInForward().to(device)
    with pytest.raises(g8.CaptureError) as err:
        g8.make_graphed_callables(m, (torch.randn(4, 16, device=device),), num_warmup_iters=1)
    msg = str(err.value)
    assert "aten._local_scalar_dense" in msg and "Tensor.item()" in msg
    assert "test_tape.py" in msg and "if y.sum().item() > 0:  # the offending line" in msg


def test_data_dependent_shape_is_caught(device):
    with pytest.raises(g8.CaptureError, match="data-dependent output shape"):
        g8.make_graphed_callables(MaskInForward(), (torch.randn(8, 4, device=device),),
                                  num_warmup_iters=1)  # fmt: skip


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_device_to_host_copy_is_caught():
    with pytest.raises(g8.CaptureError, match="device-to-host|synchronises"):
        g8.make_graphed_callables(HostCopyInForward(), (torch.randn(8, 4, device="cuda"),),
                                  num_warmup_iters=1)  # fmt: skip


class HostMaskInForward(nn.Module):
    """A boolean mask over a host tensor (as torch 2.11's FSDP2 slices its DeviceMesh with a CPU
    nonzero before each all-gather): host work once at capture, nothing for the graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        ranks = torch.arange(4)
        return self.lin(x) * float((ranks == 2).nonzero().numel())


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_host_only_ops_pass_a_cuda_capture():
    """A CUDA capture refuses data-dependent ops on device tensors only; the tape (CPU) refuses
    every one, since it replays every op."""
    m = HostMaskInForward().cuda()
    x = torch.randn(8, 4, device="cuda")
    graphed = g8.make_graphed_callables(m, (x,), num_warmup_iters=1)
    torch.testing.assert_close(graphed(x), m.lin(x))
    with pytest.raises(g8.CaptureError, match="data-dependent output shape"):
        g8.make_graphed_callables(HostMaskInForward(), (torch.randn(8, 4),), num_warmup_iters=1)


def test_tape_replays_the_recorded_ops_on_the_same_tensors():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    out = torch.empty(4, 4)
    tape = ReplayTape()
    calls = []
    with RecordingMode(tape):
        calls.append(1)  # Python runs once, at capture
        c = a @ b + 1.0
        out.copy_(c.relu())
    assert tape.op_names() == ["aten::mm", "aten::add", "aten::relu", "aten::copy_"]
    a.normal_()
    b.normal_()
    tape.replay()
    assert torch.equal(out, (a @ b + 1.0).relu())
    assert calls == [1], "replay does not run Python"


def test_tape_replays_storage_resizes_where_they_ran():
    """FSDP2 frees a gathered parameter (storage.resize_(0)) after its use and allocates it again
    (resize_(nbytes)) before the next all-gather: not dispatcher ops, so the tape records them.
    Before, a replay wrote into the storage the capture had freed."""
    src = torch.randn(8)
    gathered = torch.empty(8)
    gathered.untyped_storage().resize_(0)
    out = torch.empty(8)
    tape = ReplayTape()
    with RecordingMode(tape):
        gathered.untyped_storage().resize_(8 * 4)
        gathered.copy_(src)
        out.copy_(gathered * 2)
        gathered.untyped_storage().resize_(0)
    assert tape.op_names() == ["storage.resize_", "aten::copy_", "aten::mul", "aten::copy_",
                               "storage.resize_"]  # fmt: skip
    src.normal_()
    tape.replay()
    assert torch.equal(out, src * 2)
    assert gathered.untyped_storage().nbytes() == 0, "freed where the capture freed it"
    assert torch.UntypedStorage.resize_ is type(out.untyped_storage()).resize_


def test_tape_freezes_python_state_like_a_cuda_graph():
    """A Python number read at capture stays frozen: the bug class graphfp8 avoids by passing
    everything that changes as a device tensor."""
    scale = {"value": 2.0}
    x = torch.ones(3)
    out = torch.empty(3)
    tape = ReplayTape()
    with RecordingMode(tape):
        out.copy_(x * scale["value"])
    scale["value"] = 5.0
    tape.replay()
    assert out.tolist() == [2.0, 2.0, 2.0]


def _paths_differ_case():
    """FP8 operands whose CPU GEMM rounds differently on oneDNN's path and torch's emulation
    (on a CPU that routes FP8 to oneDNN; elsewhere both are the emulation)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(128, 32, generator=gen).to(torch.float8_e4m3fn)
    b = torch.randn(32, 32, generator=gen).to(torch.float8_e4m3fn).t().contiguous().t()
    return a, torch.tensor([0.37]), b, torch.tensor([2.5e-3])


def test_cpu_fp8_gemm_runs_the_emulation_and_replays_it():
    """fp8_gemm on the CPU runs torch's fp32 emulation whatever torch's oneDNN switch says, and
    the tape replays it on that path: replayed == eager bit for bit, also where oneDNN's path
    would round differently."""
    a, sa, b, sb = _paths_differ_case()
    with g8.ops.gemm.onednn_off():
        emulated = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    eager = g8.ops.fp8_gemm(a, sa, b, sb, torch.float32)
    assert torch.equal(eager, emulated)
    assert torch._C._get_mkldnn_enabled(), "the switch is put back"
    out = torch.empty(128, 32)
    tape = ReplayTape()
    with RecordingMode(tape):
        out.copy_(g8.ops.fp8_gemm(a, sa, b, sb, torch.float32))
    out.zero_()
    tape.replay()
    assert torch.equal(out, eager)
    onednn = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    if not torch.equal(onednn, emulated):  # this CPU takes oneDNN's path: the case bites here
        assert not torch.equal(out, onednn)


def test_tape_replays_its_ops_as_recorded_under_the_callers_autocast():
    """The recorded ops are those torch.autocast chose at capture (here none: fp32); a replay
    inside torch.autocast does not recast them, as a CUDA graph replays its kernels."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    out = torch.empty(16, 16)
    tape = ReplayTape()
    with RecordingMode(tape):
        out.copy_(a @ b)
    out.zero_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tape.replay()
    assert torch.equal(out, a @ b)
