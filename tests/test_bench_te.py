"""The TransformerEngine peer of the benchmarks (benchmarks/te_peers.py) on a machine
without TE: every TE column is left out, and the one-stream capture wrapper patches TE's graph
module and torch.cuda.Stream only while TE captures (checked on a stand-in TE module)."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from benchmarks import te_peers


def test_without_te_every_te_peer_is_left_out(monkeypatch):
    monkeypatch.setattr(te_peers, "te", lambda: None)
    assert te_peers.te_block_peers(None, None, None, 4) == {}
    assert te_peers.te_stack_step(64, 1, 1, None, None, 4) is None
    assert te_peers.te_linear_peer(None, None) is None


def _fake_te(monkeypatch):
    """A stand-in transformer_engine.pytorch whose make_graphed_callables reports the streams
    it would warm up and capture on."""
    pkg = types.ModuleType("fake_te")
    graph = types.ModuleType("fake_te.graph")
    seen = {}

    @contextlib.contextmanager
    def wrapper(*args, stream=None, **kwargs):
        seen["capture_stream"] = stream
        yield

    def make_graphed_callables(module, sample_args, **kwargs):
        seen["warmup_stream"] = torch.cuda.Stream()
        with graph._graph_context_wrapper(None):
            pass
        seen["kwargs"] = kwargs
        return module

    graph._graph_context_wrapper = wrapper
    pkg.graph = graph
    pkg.make_graphed_callables = make_graphed_callables
    monkeypatch.setitem(sys.modules, "fake_te", pkg)
    monkeypatch.setitem(sys.modules, "fake_te.graph", graph)
    monkeypatch.setattr(te_peers, "te", lambda: pkg)
    return pkg, graph, wrapper, seen


def test_same_stream_graphed_warms_up_and_captures_on_one_stream(monkeypatch):
    pkg, graph, wrapper, seen = _fake_te(monkeypatch)
    stream = object()
    real_stream = torch.cuda.Stream
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stream)
    module = torch.nn.Linear(2, 2)
    assert te_peers.same_stream_graphed(module, (), fp8_enabled=True) is module
    assert seen["warmup_stream"] is stream and seen["capture_stream"] is stream
    assert seen["kwargs"] == {"fp8_enabled": True}
    assert graph._graph_context_wrapper is wrapper, "TE's graph module is put back"
    monkeypatch.setattr(torch.cuda, "Stream", real_stream)


def test_one_stream_restores_after_a_failed_capture(monkeypatch):
    pkg, graph, wrapper, _ = _fake_te(monkeypatch)
    make_stream = torch.cuda.Stream
    with pytest.raises(RuntimeError, match="capture failed"):
        with te_peers._one_stream(pkg, object()):
            raise RuntimeError("capture failed")
    assert torch.cuda.Stream is make_stream
    assert graph._graph_context_wrapper is wrapper


def test_try_build_reports_a_failed_peer_and_goes_on():
    failures: dict = {}

    def broken():
        raise ValueError("CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED\nmore lines")

    assert te_peers.try_build("TE fp8 graphed", broken, failures) is None
    assert failures == {"TE fp8 graphed": "ValueError: CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED"}
    assert te_peers.try_build("TE ok", lambda: 3, failures) == 3
