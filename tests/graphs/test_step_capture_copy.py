"""The step graph's copy of the model that undoes its warmup (graphs/step_optim.py's
TrainingSnapshot): in host memory, so the GPU never holds a second copy of the weights and masters,
and dropped once the capture has put the state back (docs/sharding.md, "Memory planner")."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.graphs import step as step_module
from graphfp8.graphs.backends import tapes_allocate_as_cuda
from graphfp8.graphs.step_optim import TrainingSnapshot
from graphfp8.memory import LiveBytes
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import RECIPE, TinyLM, adamw, eager_step, lm_batch, lm_loss

N = 2  # microbatches


class _Watched(TrainingSnapshot):
    """A TrainingSnapshot that the test can see die: weak references to it and its copies."""

    refs: list[weakref.ref] = []

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        _Watched.refs += [weakref.ref(self)] + [weakref.ref(t) for t in self.saved]


def _model(device, fp8_weights: bool):
    if not fp8_weights:
        return TinyLM(device)
    with g8.fp8_model_init():
        return TinyLM(device)


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16", "fp8-weights"])
def test_step_graph_drops_its_capture_copy(device, fp8_weights, monkeypatch):
    """Nothing keeps the copy alive once make_graphed_step returns (before: the GraphedStep kept
    it through StepBody -> CaptureSession for the graph's whole life), and the step still equals
    the eager loop bit for bit (the copy, pinned host memory on a GPU, put the state back)."""
    _Watched.refs = []
    monkeypatch.setattr(step_module, "TrainingSnapshot", _Watched)
    eager = _model(device, fp8_weights)
    model = copy.deepcopy(eager)
    eager_masters, masters = (
        (g8.MasterWeights(eager), g8.MasterWeights(model)) if fp8_weights else (None, None)
    )
    opt_e = adamw((eager_masters or eager).parameters(), device)
    opt_g = adamw((masters or model).parameters(), device)
    step = g8.make_graphed_step(model, lm_loss, opt_g, lm_batch(N, device, 0), N,
                                fp8_enabled=True, fp8_recipe=RECIPE, max_grad_norm=0.5,
                                master_weights=masters)  # fmt: skip
    gc.collect()
    assert len(_Watched.refs) > 1
    assert all(ref() is None for ref in _Watched.refs), "the capture's copy outlives the capture"
    for s in range(2):
        batch = lm_batch(N, device, 10 + s)
        if fp8_weights:
            loss_e = _eager_master_step(eager, eager_masters, opt_e, batch)
        else:
            loss_e = eager_step(eager, lm_loss, opt_e, batch, N, max_grad_norm=0.5)[0]
        assert_bitwise_equal(step(batch), loss_e, f"loss, step {s}")
    for pg, pe in zip(model.parameters(), eager.parameters(), strict=True):
        if isinstance(pg, Float8Tensor):
            pg, pe = pg._data.view(torch.uint8), pe._data.view(torch.uint8)
        assert_bitwise_equal(pg, pe, "weights after 2 steps")


def _eager_master_step(model, masters, opt, batch):
    inputs, targets = batch
    total = torch.zeros((), device=inputs.device)
    for i in range(N):
        with g8.fp8_autocast(recipe=RECIPE):
            out = model(inputs[i], is_first_microbatch=i == 0)
        loss = lm_loss(out, targets[i]) / N
        loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    masters.step(opt)
    masters.zero_grad()
    return total


def test_failed_capture_drops_the_copy_and_restores(monkeypatch):
    """A capture that raises puts the model and optimizer back and keeps no copy either."""
    _Watched.refs = []
    monkeypatch.setattr(step_module, "TrainingSnapshot", _Watched)
    model = TinyLM("cpu")
    opt = adamw(model.parameters(), "cpu")
    before = [p.detach().clone() for p in model.parameters()]

    def failing_loss(out, targets):
        if g8.fp8.context.current().capturing:
            raise RuntimeError("injected")
        return lm_loss(out, targets)

    with pytest.raises(RuntimeError, match="injected"):
        g8.make_graphed_step(model, failing_loss, opt, lm_batch(N, "cpu", 0), N,
                             fp8_enabled=True, fp8_recipe=RECIPE)  # fmt: skip
    gc.collect()
    assert all(ref() is None for ref in _Watched.refs)
    for p, b in zip(model.parameters(), before, strict=True):
        assert_bitwise_equal(p, b, "weights restored")
    assert all(torch.count_nonzero(v) == 0 for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))  # fmt: skip


def test_snapshot_lives_in_host_memory():
    """The CPU accounting of a GPU run (tapes_allocate_as_cuda) does not count the snapshot's
    copies, which a GPU run keeps in host memory; ordinary accounting does (before: both did)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with LiveBytes() as plain:
        TrainingSnapshot(model)
    with tapes_allocate_as_cuda(), LiveBytes() as as_cuda:
        snapshot = TrainingSnapshot(model)
    assert plain.peak == nbytes
    assert as_cuda.peak == 0
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    snapshot.restore()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), snapshot.saved, strict=True))


@pytest.mark.cuda
def test_step_capture_holds_no_device_copy():
    """On the GPU the capture's peak holds the gradients, AdamW's state and the microbatch beside
    the model, not a second copy of the weights (before: one more fp32 copy of them, P bytes)."""
    torch.cuda.synchronize()
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)]).cuda()
    opt = adamw(model.parameters(), "cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(N, 4, 1024, device="cuda")
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step = g8.make_graphed_step(model, lambda out: out.float().square().mean(), opt, x, N)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    # 4 P at most: the .grad buffers, AdamW's two moments, and a microbatch's gradients before
    # they are accumulated or the square root of the second moment that capturable AdamW
    # computes; the activations and step counts are far below P / 2
    assert grown < 4.5 * weights, (grown / weights, "bytes per weight byte during capture")
    step(x)
    torch.cuda.synchronize()
