"""The FSDP2 internals that per-layer graphs call, read the same way on the torch of CI (2.13) and
of the GPU machine (2.11), whose private FSDPState / FSDPCommContext differ (docs/sharding.md,
"FSDP2 layers in make_graphed_callables")."""

from __future__ import annotations

import functools

from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
from torch.distributed.utils import _apply_to_tensors

__all__ = ["cast_forward_inputs", "cast_output", "param_groups", "wait_reduce_scatters"]


def param_groups(state) -> list:
    """An FSDPState's parameter groups: a list since torch 2.12 (`_fsdp_param_groups`), one
    optional group before (torch 2.11's `_fsdp_param_group`)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


def cast_forward_inputs(state, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The inputs cast to the MixedPrecisionPolicy's param_dtype when it says so, as FSDP2's
    pre-forward hook does (a method of FSDPState since torch 2.12, inline in 2.11)."""
    policy = state._mp_policy
    if not (policy.cast_forward_inputs and policy.param_dtype):
        return args, kwargs
    cast = functools.partial(_cast_fp_tensor, policy.param_dtype)
    return _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)


def cast_output(state, output):
    """The output cast to the policy's output_dtype, as FSDP2's post-forward hook does."""
    dtype = state._mp_policy.output_dtype
    if dtype is None:
        return output
    return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), output)


def wait_reduce_scatters(comm, stream) -> None:
    """The stream waits for the reduce-scatters FSDP2 left pending, then forgets them: a list
    since torch 2.12 (`reduce_scatter_states`), one optional state in 2.11."""
    states = getattr(comm, "reduce_scatter_states", None)
    if states is None:
        state = comm.reduce_scatter_state
        if state is not None and state.event is not None:
            stream.wait_event(state.event)
        comm.reduce_scatter_state = None
        return
    for rs in states:
        if rs.event is not None:
            stream.wait_event(rs.event)
    states.clear()
