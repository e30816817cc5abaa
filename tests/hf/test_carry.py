"""A converted model that carries its recipe trains in FP8 with no FP8 code in the loop, exactly as
the loop written with fp8_autocast trains it (issue 32, item 3): every microbatch casts the FP8
weights from their current values (issue 39: nothing cached across calls), whatever loop runs
them; evaluation runs in the mode chosen; the caller's own region wins."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8 import weight_cache
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw
from tests.hf.common import (
    RECIPE,
    assert_same_training,
    batch,
    fp8_model,
    hf_model,
    ids,
    train,
)


def explicit_train(model, opt, steps: int, flags=False) -> list[torch.Tensor]:
    """The loop written for FP8 by hand: one fp8_autocast per microbatch, is_first_microbatch
    None (what the carried model does) or, with flags, True on each step's first microbatch."""
    losses = []
    for step in range(steps):
        for mb in range(2):
            x = batch(step, mb)
            with g8.fp8_autocast(recipe=RECIPE):
                kw = {"is_first_microbatch": mb == 0 if flags else None}
                loss = model(x, labels=x, **kw).loss
            (loss / 2).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


@pytest.fixture
def cast_log(monkeypatch):
    """Each weight-cast decision of eager calls: (module, cast)."""
    log = []
    original = weight_cache.EagerCasts.casts

    def logged(self, cache, is_first_microbatch, owner):
        cast, flag = original(self, cache, is_first_microbatch, owner)
        log.append((owner, cast))
        return cast, flag

    monkeypatch.setattr(weight_cache.EagerCasts, "casts", logged)
    return log


def trains_as_the_explicit_loop(carried, kind: str):
    """3 steps of `train` on the carried model against explicit_train on a plain conversion of
    the same weights: every loss and the final state bit for bit. Returns the plain model."""
    plain = g8.from_hf(hf_model(kind).train())
    got = train(carried, torch.optim.AdamW(carried.parameters(), lr=1e-3), 3)
    want = explicit_train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), 3)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g, w, f"loss {i}")
    assert_same_training(plain, carried, "after 3 steps")
    return plain


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_carried_recipe_trains_as_the_explicit_loop(kind, cast_log):
    trains_as_the_explicit_loop(fp8_model(kind)[0], kind)
    carried = cast_log[: len(cast_log) // 2]
    assert carried and all(c for _, c in carried), "every carried microbatch casts"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_per_layer_graphs_behind_one_switch_train_as_the_explicit_loop(kind):
    """graphs="layers": captured at the first training forward, replayed in a plain loop, bit for
    bit the eager explicit loop; evaluation runs the layers eagerly."""
    graphed = g8.from_hf(hf_model(kind).train(), recipe=RECIPE, graphs="layers")
    plain = trains_as_the_explicit_loop(graphed, kind)
    assert graphed.layer_graphs.shape == tuple(batch(0, 0).shape)
    assert hasattr(graphed.layers[0], "captured_ops"), "the layers replay graphs"
    graphed.eval()
    plain.eval()
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
        x = ids(5)
        assert_bitwise_equal(graphed(x).logits, plain(x).logits, "eval runs eagerly")


def test_the_whole_step_of_a_carried_model_as_one_graph():
    """make_graphed_step on a model carrying its recipe: the capture's settings win."""
    graphed, _ = fp8_model("llama")
    opt = adamw(graphed.parameters(), "cpu")  # fused: a step graph takes its tensor state
    plain = g8.from_hf(hf_model("llama").train())
    plain_opt = adamw(plain.parameters(), "cpu")

    class WithLabels(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, x):
            return self.lm(x, labels=x).loss

    def loss_fn(loss, x):  # the step graph divides by the microbatch count
        return loss

    xs = torch.stack([batch(0, mb) for mb in range(2)])
    step = g8.make_graphed_step(WithLabels(graphed), loss_fn, opt, ((xs,), (xs,)), 2,
                                fp8_enabled=True, fp8_recipe=RECIPE,
                                num_warmup_iters=1)  # fmt: skip
    for s in range(3):
        xs = torch.stack([batch(s, mb) for mb in range(2)])
        step(((xs,), (xs,)))
    explicit_train(plain, plain_opt, 3, flags=True)
    assert_same_training(plain, graphed, "after 3 step replays")


def test_a_converted_hugging_face_model_carries_its_recipe(cast_log):
    """g8.convert(hf_model, recipe=...) in place: the HF model itself runs in FP8 by itself."""
    model = g8.convert(hf_model("llama").train(), recipe=RECIPE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, 2)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, g8.Linear) and q_proj.fp8_meta.fwd.history().abs().sum() > 0
    assert len(cast_log) == 4 * 15 and all(c for _, c in cast_log), "15 Linears cast per call"


def test_evaluation_runs_in_the_chosen_mode():
    x = ids()
    plain = g8.from_hf(hf_model("llama")).eval()  # evaluation: eval mode
    with torch.no_grad():
        bf16 = plain(x).logits
        with g8.fp8_autocast(recipe=RECIPE):
            fp8 = plain(x).logits
    for eval_fp8, want in ((False, bf16), (True, fp8)):
        lm = g8.from_hf(hf_model("llama"), recipe=RECIPE, eval_fp8=eval_fp8).eval()
        with torch.no_grad():
            assert_bitwise_equal(lm(x).logits, want, f"eval_fp8={eval_fp8}")


def test_the_callers_region_wins():
    lm = g8.from_hf(hf_model("llama"), recipe=RECIPE).eval()
    plain = g8.from_hf(hf_model("llama"))
    x = ids()
    with torch.no_grad(), g8.fp8_autocast(enabled=False):
        assert_bitwise_equal(lm(x).logits, plain(x).logits)


def test_carried_settings_are_checked():
    with pytest.raises(TypeError, match="eval_fp8 must be a bool"):
        g8.from_hf(hf_model("llama"), recipe=RECIPE, eval_fp8=1)
    with pytest.raises(TypeError, match="recipe must be a graphfp8"):
        g8.from_hf(hf_model("llama"), recipe="fp8")
