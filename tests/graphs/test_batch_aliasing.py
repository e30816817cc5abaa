"""Sample batches whose tensors share memory, and calls that pass the static buffers at other
positions (make_graphed_microbatch, make_graphed_step, make_graphed_callables): each equals the
eager code on the tensors the caller passed, bit for bit."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.common import QKV, compare_models
from tests.graphs.step_common import (
    RECIPE,
    VOCAB,
    B,
    S,
    TinyLM,
    adamw,
    compare_step,
    compare_training_state,
    eager_step,
    lm_loss,
)
from tests.modules.common import H, T, build

FP8 = dict(fp8_enabled=True, fp8_recipe=RECIPE)


def _mse(y, t):
    return F.mse_loss(y.float(), t.float())


def _eager_microbatch(model, batch, first):
    with g8.fp8_autocast(recipe=RECIPE):
        out = model(batch[0], is_first_microbatch=first)
    loss = _mse(out, batch[1])
    loss.backward()
    return loss.detach()


def _bf16(device):
    return torch.randn(T, H, dtype=torch.bfloat16, device=device)


def test_one_tensor_as_inputs_and_targets_of_the_sample(device):
    """(x, x) as the sample (an autoencoder's batch), then distinct inputs and targets: the graph
    read both from one buffer, so every call saw (targets, targets)."""
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    x = _bf16(device)
    g = g8.make_graphed_microbatch(model, _mse, (x, x), fp8_weight_caching=True, **FP8)
    for mb, batch in enumerate([(_bf16(device), _bf16(device)), (x, x), (_bf16(device),) * 2]):
        want = _eager_microbatch(eager, batch, mb == 0)
        got = g(batch, is_first_microbatch=mb == 0)
        assert_bitwise_equal(got, want, f"mb {mb}: loss")
        compare_models(eager, model, f"mb {mb}")


def test_static_buffers_passed_at_other_positions(device):
    """The static input buffer passed as the targets, with new inputs: the targets are the
    buffer's values before this call's inputs are copied in (as eagerly)."""
    eager = build("LayerNormMLP", device=device)
    model = copy.deepcopy(eager)
    g = g8.make_graphed_microbatch(model, _mse, (_bf16(device), _bf16(device)), **FP8)
    static_in, static_target = g.static_batch
    for mb in range(3):
        old = static_in.clone()
        batch = (_bf16(device), static_in) if mb != 1 else (static_target, static_in)
        want = _eager_microbatch(eager, (batch[0].clone(), old), None)
        got = g(batch)
        assert_bitwise_equal(got, want, f"mb {mb}: loss")
        compare_models(eager, model, f"mb {mb}")


def _tokens(n, device, seed):
    """(n, B, S + 1) int64 tokens; views [..., :-1] and [..., 1:] are inputs and targets."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, B, S + 1), generator=gen).to(device)


def test_overlapping_views_as_inputs_and_targets_of_the_sample(device):
    """The sample is (data[..., :-1], data[..., 1:]), the usual language-model shift, as views of
    one tensor; later batches are unrelated tokens. The two buffers overlapped, so copying the
    targets overwrote most of the inputs."""
    eager = TinyLM(device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    data = _tokens(2, device, 99)
    step = g8.make_graphed_step(model, lm_loss, opt_g, (data[..., :-1], data[..., 1:]), 2,
                                num_warmup_iters=1, **FP8)  # fmt: skip
    for s in range(2):
        batch = (_tokens(2, device, s)[..., :-1], _tokens(2, device, 10 + s)[..., 1:])
        result = eager_step(eager, lm_loss, opt_e, batch, 2)
        step(batch)
        compare_step(step, result, f"step {s}")
        compare_training_state(eager, model, opt_e, opt_g, f"step {s}")


def test_a_callables_sample_tensors_passed_at_other_positions(device):
    """g(b, a, c) after capturing with (a, b, c): each input is read before any static input is
    written (the copy of b into a's buffer changed what position 1 read)."""
    eager = QKV(device)
    model = copy.deepcopy(eager)
    a, b, c = (_bf16(device).requires_grad_() for _ in range(3))
    g = g8.make_graphed_callables(model, (a, b, c), fp8_enabled=True, fp8_recipe=RECIPE)
    for mb, order in enumerate([(b, a, c), (c, b, a), (a, b, c)]):
        inputs = [t.detach().clone().requires_grad_() for t in order]
        with g8.fp8_autocast(recipe=RECIPE):
            want = eager(*inputs)
        got = g(*order)
        assert_bitwise_equal(got, want, f"call {mb}: output")
        want.float().square().sum().backward()
        got.float().square().sum().backward()
        compare_models(eager, model, f"call {mb}")


def test_the_sample_batch_is_never_overwritten(device):
    """Issue 39: make_graphed_step and make_graphed_microbatch made the sample batch's tensors
    their static buffers, so every later batch overwrote the caller's sample (as
    make_graphed_callables did its sample args: tests/graphs/test_call_misuse.py). Now each
    entry point copies the sample; later calls equal eager on the batches they were given."""
    eager = TinyLM(device)
    model = copy.deepcopy(eager)
    opt_e, opt_g = adamw(eager.parameters(), device), adamw(model.parameters(), device)
    data = _tokens(2, device, 99)
    sample = (data[..., :-1], data[..., 1:])
    kept = [t.clone() for t in sample]
    step = g8.make_graphed_step(model, lm_loss, opt_g, sample, 2, num_warmup_iters=1, **FP8)
    for s in range(2):
        batch = (_tokens(2, device, s)[..., :-1], _tokens(2, device, 10 + s)[..., 1:])
        result = eager_step(eager, lm_loss, opt_e, batch, 2)
        step(batch)
        compare_step(step, result, f"step {s}")
    for t, k in zip(sample, kept, strict=True):
        assert_bitwise_equal(t, k, "the step's sample batch")
    mb_model = build("LayerNormMLP", device=device)
    x, t = _bf16(device), _bf16(device)
    kept = [x.clone(), t.clone()]
    g = g8.make_graphed_microbatch(mb_model, _mse, (x, t), **FP8)
    g((_bf16(device), _bf16(device)))
    assert_bitwise_equal(x, kept[0], "the microbatch's sample input")
    assert_bitwise_equal(t, kept[1], "the microbatch's sample target")
