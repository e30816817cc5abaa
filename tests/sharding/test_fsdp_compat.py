"""graphs/fsdp_compat.py reads FSDP2's internals in torch 2.11's shape (the GPU machine's: one
optional param group, one optional reduce-scatter state, the casts inline in the hooks) and in
2.12+'s (lists, FSDPState methods): the first CUDA run of per-layer FSDP2 graphs failed on each
2.11 difference (AttributeError), so both shapes are checked here with stand-ins."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from graphfp8.graphs.fsdp_compat import (
    cast_forward_inputs,
    cast_output,
    param_groups,
    wait_reduce_scatters,
)


class _Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def test_param_groups_of_both_torch_versions():
    assert param_groups(SimpleNamespace(_fsdp_param_groups=("a", "b"))) == ["a", "b"]
    assert param_groups(SimpleNamespace(_fsdp_param_group="g")) == ["g"]
    assert param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_wait_reduce_scatters_torch_2_11_single_state():
    stream, rs = _Stream(), SimpleNamespace(event="e0")
    comm = SimpleNamespace(reduce_scatter_state=rs)
    wait_reduce_scatters(comm, stream)
    assert stream.waited == ["e0"] and comm.reduce_scatter_state is None
    wait_reduce_scatters(comm, stream)  # nothing pending: nothing waited
    assert stream.waited == ["e0"]


def test_wait_reduce_scatters_list_of_states():
    stream = _Stream()
    comm = SimpleNamespace(reduce_scatter_states=[SimpleNamespace(event="e1"),
                                                  SimpleNamespace(event=None)])  # fmt: skip
    wait_reduce_scatters(comm, stream)
    assert stream.waited == ["e1"] and comm.reduce_scatter_states == []


def _state(cast_inputs, param_dtype, output_dtype):
    policy = SimpleNamespace(cast_forward_inputs=cast_inputs, param_dtype=param_dtype,
                             output_dtype=output_dtype)  # fmt: skip
    return SimpleNamespace(_mp_policy=policy)


def test_casts_follow_the_mixed_precision_policy():
    x, i = torch.randn(2, 3), torch.arange(3)
    state = _state(True, torch.bfloat16, torch.float32)
    (a, b), kw = cast_forward_inputs(state, (x, i), {"y": x})
    assert a.dtype == torch.bfloat16 and kw["y"].dtype == torch.bfloat16 and b is i
    assert torch.equal(a, x.to(torch.bfloat16))
    assert cast_output(state, (a,))[0].dtype == torch.float32
    off = _state(False, torch.bfloat16, None)
    (a2,), _ = cast_forward_inputs(off, (x,), {})
    assert a2 is x and cast_output(off, x) is x
