"""allreduce_gradients when the ranks hold different gradients (issue 25, row 8): a clear
RuntimeError on every rank, naming the parameter, before any gradient is touched (gloo aborted
the process: `op.preamble.length <= op.nbytes`; NCCL hangs or mixes unrelated values)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from graphfp8.distributed import allreduce_gradients
from tests.rank_pool import run_on_ranks
from tests.test_distributed import BACKENDS


def _model(device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)).to(device)


def _unused_parameter_on_one_rank(rank, device):
    """Rank 1 never runs the second layer: its weight and bias have no grad there."""
    model = _model(device)
    x = torch.randn(4, 16, device=device)
    y = model(x) if rank == 0 else model[0](x)
    y.square().sum().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    match = (
        r"ranks hold different gradients.*parameter 2 \(\(8, 16\) torch.float32\) has a "
        r"gradient on rank 0, none on rank 1; parameter 3 \(\(8,\) torch.float32\)"
    )
    with pytest.raises(RuntimeError, match=match):
        allreduce_gradients(model.parameters())
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "grads touched"
    # The group still works: the same call with the same gradients on both ranks goes through.
    allreduce_gradients(model[0].parameters())


def _other_shape_dtype_or_settings(rank, device, case):
    grads = [torch.ones(4, 4, device=device), torch.ones(3, device=device)]
    kwargs = {}
    if rank == 1 and case == "shape":
        grads[1] = torch.ones(5, device=device)
    if rank == 1 and case == "dtype":
        grads[1] = grads[1].to(torch.bfloat16)
    if rank == 1 and case == "bucket_mb":
        kwargs["bucket_mb"] = 1.0
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    match = {
        "shape": r"parameter 1 has a \(3,\) torch.float32 gradient on rank 0, a \(5,\) "
        r"torch.float32 one on rank 1",
        "dtype": r"a \(3,\) torch.bfloat16 one on rank 1",
        "bucket_mb": r"rank 1 has \(bucket bytes, average\) \(1048576, True\)",
    }[case]
    with pytest.raises(RuntimeError, match=match):
        allreduce_gradients(params, **kwargs)


def _checked_once_per_set_when_asked(rank, device):
    """check_every_step=False: one all_gather for a gradient set, however many calls; a new
    set is checked again. The default checks every call."""
    calls = []
    gather = dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    dist.all_gather = counting
    try:
        p = torch.nn.Parameter(torch.zeros(6, device=device))
        p.grad = torch.ones(6, device=device)
        for _ in range(3):
            allreduce_gradients([p], check_every_step=False)
        assert len(calls) == 1
        q = torch.nn.Parameter(torch.zeros(2, device=device))
        q.grad = torch.ones(2, device=device)
        allreduce_gradients([p, q], check_every_step=False)
        assert len(calls) == 2
        allreduce_gradients([p, q])
        allreduce_gradients([p, q])
        assert len(calls) == 4
    finally:
        dist.all_gather = gather


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unused_parameter_on_one_rank_raises_on_every_rank(backend):
    run_on_ranks(backend, _unused_parameter_on_one_rank)


@pytest.mark.parametrize("case", ["shape", "dtype", "bucket_mb"])
def test_other_shapes_dtypes_or_settings_raise_on_every_rank(case):
    run_on_ranks("gloo", _other_shape_dtype_or_settings, case)


def test_the_check_runs_once_per_set_when_asked():
    run_on_ranks("gloo", _checked_once_per_set_when_asked)
