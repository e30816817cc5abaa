"""fuse_wgrad_accumulation after capture, in every capture entry point: a main_grad replaced by
another tensor is refused before anything runs (a view of the same memory is taken), and
`grad_added_to_main_grad` is set by each replay's backward as by the eager one
(docs/after-capture.md; docs/fp8.md, "Weight-gradient accumulation")."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import RECIPE, B, H, S, adamw, eager_step, lm_batch, lm_loss
from tests.graphs.test_fuse_wgrad_graphs import CAPTURE, N, _compare, _eager_microbatches, _pair
from tests.helpers import DEVICES
from tests.modules.common import fp8_state
from tests.modules.test_fuse_wgrad import gemm_weights

ENTRY_POINTS = ["callables", "microbatch", "step"]


def _graphed(kind: str, model, device):
    """run(batch): one training step of `model` through the `kind` entry point's graphs."""
    if kind == "callables":
        sample = (torch.randn(B, S, H, dtype=torch.bfloat16, device=device, requires_grad=True),)
        (block,) = g8.make_graphed_callables((model.block,), (sample,), fp8_weight_caching=True,
                                             **CAPTURE)  # fmt: skip

        def run(batch):
            for i in range(N):
                with g8.fp8_autocast(recipe=RECIPE):
                    h = block(model.embed(batch[0][i]), is_first_microbatch=i == 0)
                    out = model.head(model.norm(h), is_first_microbatch=i == 0)
                (lm_loss(out, batch[1][i]) / N).backward()

        return run
    if kind == "microbatch":
        tokens, targets = lm_batch(1, device, 99)
        micro = g8.make_graphed_microbatch(model, lm_loss, (tokens[0], targets[0]), N,
                                           fp8_weight_caching=True, **CAPTURE)  # fmt: skip

        def run(batch):
            for i in range(N):
                micro((batch[0][i], batch[1][i]), is_first_microbatch=i == 0)

        return run
    return g8.make_graphed_step(model, lm_loss, adamw(model.parameters(), device),
                                lm_batch(N, device, 99), N, **CAPTURE)  # fmt: skip


def _eager(kind: str, model, device):
    if kind != "step":
        return lambda batch: _eager_microbatches(model, batch)
    opt = adamw(model.parameters(), device)
    return lambda batch: eager_step(model, lm_loss, opt, batch, N, recipe=RECIPE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_replaced_main_grad_refused_before_anything_runs(kind, device):
    """Before the fix, the replay added into the old tensor and left the new one at zero."""
    _, model = _pair(device)
    run = _graphed(kind, model, device)
    run(lm_batch(N, device, 0))
    w = gemm_weights(model)[1]
    old = w.main_grad
    kept_old, kept = old.clone(), [t.clone() for _, t in fp8_state(model)]
    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"main_grad of .* replaced after capture.*zero_\(\)"):
        run(lm_batch(N, device, 1))
    assert_bitwise_equal(old, kept_old, "the old main_grad")
    assert not w.main_grad.any(), "the new main_grad was written"
    for (name, t), k in zip(fp8_state(model), kept, strict=True):
        assert_bitwise_equal(t, k, f"{name} changed before the refusal")
    del w.main_grad  # deleted: refused too
    with pytest.raises(RuntimeError, match="it was deleted"):
        run(lm_batch(N, device, 1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["callables", "step"])
def test_main_grad_of_the_same_memory_taken(kind, device):
    """A new tensor object over the captured memory (a view into a flat buffer made again) is
    what the graph writes: replays go on, equal to eager, and it is zeroed in place."""
    eager, model = _pair(device)
    run, run_eager = _graphed(kind, model, device), _eager(kind, eager, device)
    for step in range(2):
        for w in gemm_weights(model):
            w.main_grad = w.main_grad.view(w.shape)
        batch = lm_batch(N, device, step)
        run_eager(batch)
        run(batch)
        _compare(eager, model, f"step {step}", grads=kind != "step")
        for m in (eager, model):
            for w in gemm_weights(m):
                w.main_grad.zero_()
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_grad_added_to_main_grad_as_eager(kind, device):
    """Megatron's flag, on every parameter: capture leaves it as it was, each step sets it on the
    fused weights only, eagerly and graphed alike. Before the fix replays never set it."""
    eager, model = _pair(device)
    for p in (*eager.parameters(), *model.parameters()):
        p.grad_added_to_main_grad = False
    run, run_eager = _graphed(kind, model, device), _eager(kind, eager, device)
    assert not any(p.grad_added_to_main_grad for p in model.parameters()), "after capture"
    fused = {id(w) for w in gemm_weights(model)}
    for step in range(2):
        batch = lm_batch(N, device, step)
        run_eager(batch)
        run(batch)
        flags = [p.grad_added_to_main_grad for p in model.parameters()]
        assert flags == [p.grad_added_to_main_grad for p in eager.parameters()], f"step {step}"
        assert flags == [id(p) in fused for p in model.parameters()], f"step {step}"
        for p in (*eager.parameters(), *model.parameters()):
            p.grad_added_to_main_grad = False


@pytest.mark.parametrize("device", DEVICES)
def test_main_grad_replaced_between_forward_and_backward(device):
    """A graphed callable's backward graph is what adds into main_grad: refused before it runs."""
    _, model = _pair(device)
    _graphed("callables", model, device)
    tokens, targets = lm_batch(1, device, 0)
    with g8.fp8_autocast(recipe=RECIPE):
        out = model.head(model.norm(model.block(model.embed(tokens[0]))))
    w = gemm_weights(model.block)[0]
    old, kept = w.main_grad, w.main_grad.clone()
    w.main_grad = torch.zeros_like(old)
    with pytest.raises(RuntimeError, match=r"replaced after capture.*zero_\(\)"):
        lm_loss(out, targets[0]).backward()
    assert_bitwise_equal(old, kept, "the old main_grad")
    assert not w.main_grad.any(), "the new main_grad was written"
