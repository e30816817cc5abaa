"""Clipping FP8 primary weights' gradients through MasterWeights (issue 25, row 4): the usual
`clip_grad_norm_(masters.parameters(), c)` before `masters.step(opt)` clips every gradient by the
joint norm, exactly as a high-precision model's clipping does, eagerly and graphed; the
optimizer's own zero_grad clears the FP8 weights' gradients too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.utils import clip_grad_norm_

import graphfp8 as g8
from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, T

CURRENT = g8.Float8CurrentScaling()
MAX_NORM = 0.05  # well below the gradients' norm: the clip always scales


def _fp8_model(dtype, device):
    torch.manual_seed(7)
    with g8.fp8_model_init():
        return g8.LayerNormMLP(H, 2 * H, params_dtype=dtype, device=device)


def _high_precision_twin(f8):
    """The same model with each FP8 weight replaced by its dequantized fp32 value."""
    hp = copy.deepcopy(f8)
    for name, p in f8.named_parameters():
        if isinstance(p, Float8Tensor):
            mod_name, _, attr = name.rpartition(".")
            setattr(hp.get_submodule(mod_name), attr, torch.nn.Parameter(p.dequantize()))
    return hp


def _in_masters_order(hp, masters) -> list[torch.Tensor]:
    """hp's parameters in masters.parameters()' order (the FP8 weights first): the joint norm
    sums the per-tensor norms in this order."""
    named = dict(hp.named_parameters())
    fp8 = set(masters.names)
    return [named[n] for n in masters.names] + [p for n, p in named.items() if n not in fp8]


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graphed"])
def test_clipping_the_masters_equals_high_precision_clipping(device, graphed):
    """float32 parameters and current scaling (where MasterWeights training equals the
    high-precision model bit for bit): the same clip on both gives the same norms and masters."""
    f8 = _fp8_model(torch.float32, device)
    masters = g8.MasterWeights(f8)
    hp = _high_precision_twin(f8)
    call = f8
    if graphed:
        sample = torch.randn(T, H, device=device, requires_grad=True)
        call = g8.make_graphed_callables(f8, (sample,), fp8_enabled=True, fp8_recipe=CURRENT,
                                         fp8_weight_caching=True)  # fmt: skip
    params = masters.parameters()  # kept, as a training loop keeps model.parameters()
    # One AdamW implementation for both: torch steps the masters (a tensor subclass) with its
    # for-loop one by default, plain CUDA tensors with foreach (1-ulp apart: H200 2026-12-01).
    opt_f8 = torch.optim.AdamW(params, lr=1e-2, foreach=False)
    hp_params = _in_masters_order(hp, masters)
    opt_hp = torch.optim.AdamW(hp_params, lr=1e-2, foreach=False)
    for step in range(3):
        for mb in range(2):
            x = torch.randn(T, H, device=device) * 10.0 ** (mb - 1)
            with g8.fp8_autocast(recipe=CURRENT):
                y_hp = hp(x.clone(), is_first_microbatch=mb == 0)
                y_f8 = call(x.clone().requires_grad_(), is_first_microbatch=mb == 0)
            y_hp.square().sum().backward()
            y_f8.square().sum().backward()
        norm_hp = clip_grad_norm_(hp_params, MAX_NORM)
        norm_f8 = clip_grad_norm_(params, MAX_NORM)
        assert norm_hp > 10 * MAX_NORM
        assert_bitwise_equal(norm_f8, norm_hp, f"step {step}: total norm")
        for m, p in zip(params, hp_params, strict=True):
            assert_bitwise_equal(m.grad, p.grad, f"step {step}: clipped grad")
        opt_hp.step()
        masters.step(opt_f8)
        opt_hp.zero_grad()
        masters.zero_grad()
        for m, p in zip(params, hp_params, strict=True):
            assert_bitwise_equal(m, p, f"step {step}: parameter")


def test_bf16_masters_see_every_gradient(device):
    """bf16 FP8 weights: the masters' fp32 grads are the FP8 weights' grads, so the joint norm
    is the norm of all of them (before the fix only the biases and norm weights had a grad)."""
    f8 = _fp8_model(torch.bfloat16, device)
    masters = g8.MasterWeights(f8)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    with g8.fp8_autocast(recipe=CURRENT):
        f8(x, is_first_microbatch=True).float().square().sum().backward()
    weight_grads = [p.grad.float() for p in masters.fp8_params]
    # Per-tensor norms in each grad's dtype (fp32 masters, bf16 biases), then their norm.
    norms = [torch.linalg.vector_norm(g) for g in weight_grads]
    norms += [torch.linalg.vector_norm(p.grad).float() for p in masters.others]
    expected = torch.linalg.vector_norm(torch.stack(norms))
    norm = clip_grad_norm_(masters.parameters(), MAX_NORM)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    coef = MAX_NORM / (norm + 1e-6)
    for m, g in zip(masters.masters, weight_grads, strict=True):
        torch.testing.assert_close(m.grad, g * coef, rtol=1e-6, atol=0)
    assert all(p.grad is None for p in masters.fp8_params)  # moved into the masters


def test_clipping_the_model_parameters_still_works(device):
    """The other way round: clipping model.parameters() (the FP8 weights' own grads) before
    masters.step() gives the masters the clipped grads."""
    f8 = _fp8_model(torch.float32, device)
    masters = g8.MasterWeights(f8)
    x = torch.randn(T, H, device=device)
    with g8.fp8_autocast(recipe=CURRENT):
        f8(x, is_first_microbatch=True).square().sum().backward()
    clip_grad_norm_(f8.parameters(), MAX_NORM)
    clipped = [p.grad.clone() for p in masters.fp8_params]
    masters.copy_grads_()
    for m, g in zip(masters.masters, clipped, strict=True):
        assert_bitwise_equal(m.grad, g, "master grad")


def test_optimizer_zero_grad_clears_the_fp8_weights_grads(device):
    """opt.zero_grad() in place of masters.zero_grad(): the FP8 weights' grads were moved into
    the masters by the step, so nothing leaks into the next step (before, they accumulated)."""
    runs = []
    for zero in ("masters", "optimizer"):
        f8 = _fp8_model(torch.bfloat16, device)
        masters = g8.MasterWeights(f8)
        opt = torch.optim.SGD(masters.parameters(), lr=0.1)
        torch.manual_seed(3)
        for _ in range(2):
            x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
            with g8.fp8_autocast(recipe=CURRENT):
                f8(x, is_first_microbatch=True).float().square().sum().backward()
            masters.step(opt)
            (masters if zero == "masters" else opt).zero_grad(set_to_none=True)
        runs.append([m.detach().clone() for m in masters.masters])
    for a, b in zip(*runs, strict=True):
        assert_bitwise_equal(b, a, "masters after 2 steps")
