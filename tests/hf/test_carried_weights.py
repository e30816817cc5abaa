"""The carried recipe never runs stale FP8 weights, and evaluation does not move training (issue
39, items 1 and 2): whatever changes the weights between two FP8 forwards - a fused or foreach
AdamW, an SGD written through `p.data`, an EMA swap through `p.data.copy_`, a LoRA merge - the
carried model trains and evaluates bit for bit as the loop written with fp8_autocast by hand;
an evaluation forward and generate() between steps, eager or with graphs="layers", leave
training as it was. Each failed before: the carried weight cache watched version counters, which
these writes do not bump, and an eval-mode call recorded amaxes and moved the scales."""

from __future__ import annotations

import contextlib

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.hf.common import RECIPE, assert_same_training, batch, hf_model, ids

STEPS, MICRO, LR = 2, 2, 1e-3


def _adamw(**kw):
    return lambda params: torch.optim.AdamW(params, lr=LR, **kw)


class DataSGD:
    """A hand-written SGD that writes through `p.data` (no version counter bumped)."""

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]

    def step(self):
        for p in self.params:
            p.data.add_(p.grad, alpha=-LR * 10)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _run(model, make_opt, explicit: bool, between=None) -> list[torch.Tensor]:
    """STEPS x MICRO microbatches: no FP8 code (the carried model), or each in fp8_autocast with
    is_first_microbatch=None (the hand-written loop; a converted HF model's layers get None from
    HF's forward); `between(model)` after each step. Returns the losses and what between
    returned."""
    opt, out = make_opt(model.parameters()), []
    kw = {"is_first_microbatch": None} if explicit and isinstance(model, g8.hf.CausalLM) else {}
    for step in range(STEPS):
        for mb in range(MICRO):
            x = batch(step, mb)
            with g8.fp8_autocast(recipe=RECIPE) if explicit else contextlib.nullcontext():
                loss = model(x, labels=x, **kw).loss
            (loss / MICRO).backward()
            out.append(loss.detach())
        opt.step()
        opt.zero_grad()
        if between is not None:
            out += between(model, explicit)
    return out


def _same(got, want, carried, plain, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"{what}: output {i}")
    assert_same_training(plain, carried, what)


OPTIMIZERS = {"fused AdamW": _adamw(fused=True), "foreach AdamW": _adamw(foreach=True),
              "SGD through p.data": DataSGD}  # fmt: skip


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_converted_model_sees_every_optimizer_step(name):
    """g8.convert(model, recipe=) against g8.convert(model) inside fp8_autocast."""
    carried = g8.convert(hf_model("llama").train(), recipe=RECIPE)
    plain = g8.convert(hf_model("llama").train())
    got = _run(carried, OPTIMIZERS[name], explicit=False)
    want = _run(plain, OPTIMIZERS[name], explicit=True)
    _same(got, want, carried, plain, name)


def _ema_eval(model, explicit: bool) -> list[torch.Tensor]:
    """The diffusers pattern: EMA weights swapped in with p.data.copy_ for an evaluation, then
    the training weights back; the EMA follows the weights (decay 0.5)."""
    params = list(model.parameters())
    if not hasattr(model, "_ema"):
        model._ema = [p.detach().clone() for p in params]
    backup = [p.detach().clone() for p in params]
    for e, p in zip(model._ema, params, strict=True):
        e.mul_(0.5).add_(p.detach(), alpha=0.5)
        p.data.copy_(e)
    model.eval()
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE) if explicit else contextlib.nullcontext():
        logits = model(ids(5)).logits
    model.train()
    for b, p in zip(backup, params, strict=True):
        p.data.copy_(b)
    return [logits]


def test_ema_weights_swapped_in_through_data_are_used():
    carried, plain = (g8.from_hf(hf_model("llama").train(), recipe=RECIPE),
                      g8.from_hf(hf_model("llama").train()))  # fmt: skip
    got = _run(carried, _adamw(fused=True), False, _ema_eval)
    want = _run(plain, _adamw(fused=True), True, _ema_eval)
    _same(got, want, carried, plain, "EMA eval between steps")


def test_a_lora_merge_is_used_by_the_next_forwards():
    """peft LoRA (graphfp8.lora) trained one step, merged into the base (merge_and_unload), then
    two training forwards and an evaluation: the carried model as the explicit loop."""
    peft = pytest.importorskip("peft")
    import graphfp8.lora as gl

    outs = []
    for carried in (True, False):
        lm = g8.from_hf(hf_model("llama").train(), recipe=RECIPE if carried else None)
        config = gl.register(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj"]))
        model = peft.get_peft_model(lm, config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        region = contextlib.nullcontext if carried else lambda: g8.fp8_autocast(recipe=RECIPE)
        x = batch(0, 0)
        with region():
            model(x, labels=x).loss.backward()
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                          fused=True).step()  # fmt: skip
        merged = model.merge_and_unload()
        got = []
        for _ in range(2):
            with region(), torch.no_grad():
                got.append(merged(x).logits)
        merged.eval()
        with region(), torch.no_grad():
            got.append(merged(x).logits)
        outs.append((got, merged))
    (got, carried), (want, plain) = outs
    _same(got, want, carried, plain, "after merge_and_unload")


def _evaluate_and_generate(model, explicit: bool) -> list[torch.Tensor]:
    model.eval()
    with g8.fp8_autocast(recipe=RECIPE) if explicit else contextlib.nullcontext():
        with torch.no_grad():
            model(ids(7), labels=ids(7))
        model.generate(ids(8)[:, :8], max_new_tokens=3, do_sample=False)
    model.train()
    return []


@pytest.mark.parametrize("graphs", [None, "layers"])
def test_evaluation_and_generate_between_steps_leave_training_as_it_was(graphs):
    """A run with an evaluation forward and generate() after each step ends bit for bit where
    the run without them does, for the carried model (eager and graphed) and the explicit loop;
    graphed equals eager."""
    runs = {}
    for evaluate in (False, True):
        carried = g8.from_hf(hf_model("llama").train(), recipe=RECIPE, graphs=graphs)
        between = _evaluate_and_generate if evaluate else None
        runs[evaluate] = (_run(carried, _adamw(fused=True), False, between), carried)
    _same(*runs[True][:1], *runs[False][:1], runs[True][1], runs[False][1], "carried")
    if graphs is None:
        plain = g8.from_hf(hf_model("llama").train())
        _same(_run(plain, _adamw(fused=True), True, _evaluate_and_generate), runs[False][0],
              plain, runs[False][1], "the explicit loop")  # fmt: skip
    else:
        assert hasattr(runs[True][1].layers[0], "captured_ops"), "the layers replayed graphs"
        eager = g8.from_hf(hf_model("llama").train(), recipe=RECIPE)
        _same(_run(eager, _adamw(fused=True), False), runs[True][0], eager, runs[True][1],
              "graphed == eager")  # fmt: skip
