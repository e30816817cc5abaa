"""load_state_dict of a graphfp8 layer checks its whole entry - FP8 state, recipe, history
length, shapes - before writing any of it (issue 25, row 6): a checkpoint it cannot take leaves
the module exactly as it was, and the error names the checkpoint, not "the recipe"."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.fp8.recipe import recipe_to_dict
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, T, build, extra_state, fp8_state


def _ran(recipe, seed: int, kind: str = "Linear"):
    torch.manual_seed(seed)
    m = build(kind)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    with g8.fp8_autocast(recipe=recipe):
        m(x, is_first_microbatch=True).float().square().sum().backward()
    return m


def _everything(m) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach().clone()) for n, p in m.named_parameters()] + [
        (n, t.clone()) for n, t in fp8_state(m)
    ]


def _assert_unchanged(m, before, what: str) -> None:
    for (name, t), (_, b) in zip(_everything(m), before, strict=True):
        assert_bitwise_equal(t, b, f"{what}: {name} was written")


H4, H16 = g8.DelayedScaling(amax_history_len=4), g8.DelayedScaling(amax_history_len=16)


def _mangled(key: str, value):
    def apply(state):  # through the dict form that older graphfp8 versions wrote
        old = extra_state(state["_extra_state"])
        state["_extra_state"] = {**old, "recipe": recipe_to_dict(old["recipe"]), key: value}
        return state

    return apply


CASES = {
    "another history length": (
        lambda s: _ran(H16, 2).state_dict(),
        ValueError,
        "checkpoint's FP8 state .* has amax_history_len=16, the module's FP8 state has 4",
    ),
    "another slot count": (
        lambda s: _mangled("fwd_amax_history", torch.zeros(4, 2))(s),
        ValueError,
        r"fwd amax history \(4, 2\) and scale \(3,\); this module's are \(4, 3\)",
    ),
    "an invalid recipe": (
        lambda s: _mangled("recipe", {"fp8_format": "E9M9"})(s),
        ValueError,
        "invalid recipe",
    ),
    "a newer version": (lambda s: _mangled("version", 7)(s), ValueError, "has version 7"),
    "a non-tensor history": (
        lambda s: _mangled("bwd_scale", [1.0, 1.0, 1.0])(s),
        ValueError,
        "non-tensors",
    ),
    "another weight shape": (
        lambda s: {**s, "weight": torch.zeros(H, H, dtype=torch.bfloat16)},
        RuntimeError,
        r"size mismatch for weight.*nothing of the module was loaded",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refused_checkpoint_changes_nothing(case):
    make, error, match = CASES[case]
    m = _ran(H4, 1)
    checkpoint = make(_ran(H4, 2).state_dict())
    before = _everything(m)
    with pytest.raises(error, match=match):
        m.load_state_dict(checkpoint)
    _assert_unchanged(m, before, case)


def test_a_module_inside_a_model_is_named():
    model = torch.nn.Sequential(build("LayerNormMLP"), build("Linear"))
    with g8.fp8_autocast(recipe=H4):
        model(torch.randn(T, H, dtype=torch.bfloat16))
    other = torch.nn.Sequential(build("LayerNormMLP"), build("Linear"))
    with g8.fp8_autocast(recipe=H16):
        other(torch.randn(T, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^LayerNormMLP 0: the checkpoint's FP8 state"):
        model.load_state_dict(other.state_dict())


def test_a_captured_module_refuses_another_recipe_before_writing():
    m = _ran(H4, 1)
    sample = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    g8.make_graphed_callables(m, (sample,), fp8_enabled=True, fp8_recipe=H4)
    checkpoint = _ran(g8.DelayedScaling(amax_history_len=4, margin=1), 2).state_dict()
    before = _everything(m)
    with pytest.raises(RuntimeError, match="captured in a graph"):
        m.load_state_dict(checkpoint)
    _assert_unchanged(m, before, "captured")


def test_a_checkpoint_without_fp8_state_resets_it():
    """A module that never ran in FP8 saves an empty _extra_state (versions 0 and 1: None), a
    high-precision checkpoint none: loading either gives the FP8 state a fresh module loading it
    holds (it kept the old histories and scales; strict=True failed on the missing key)."""
    for checkpoint in (build("Linear").state_dict(), {"_extra_state": None}, "no key"):
        m = _ran(H4, 1)
        if checkpoint == "no key":
            checkpoint = build("Linear").state_dict()
            del checkpoint["_extra_state"]
        elif "weight" not in checkpoint:
            checkpoint = {**build("Linear").state_dict(), **checkpoint}
        m.load_state_dict(checkpoint)
        for name, t in fp8_state(m):
            want = torch.ones_like(t) if name.endswith("scale") else torch.zeros_like(t)
            assert_bitwise_equal(t, want, name)


def test_a_partial_checkpoint_leaves_the_fp8_state_alone():
    """A state dict without this module's weights (adapters, another part of the model) is not a
    checkpoint of it: its FP8 state stays, and the key is reported missing as torch does."""
    m = _ran(H4, 1)
    before = _everything(m)
    result = m.load_state_dict({}, strict=False)
    assert "_extra_state" in result.missing_keys
    _assert_unchanged(m, before, "partial load")


def test_loaded_weights_invalidate_the_weight_cache():
    """New weights loaded without FP8 state (strict=False) made is_first_microbatch=False reuse
    the FP8 cast of the old ones."""
    m = _ran(H4, 1)
    checkpoint = _ran(H4, 2).state_dict()
    del checkpoint["_extra_state"]
    m.load_state_dict(checkpoint, strict=False)
    with g8.fp8_autocast(recipe=H4), pytest.raises(RuntimeError, match="no cached FP8 weight"):
        m(torch.randn(T, H, dtype=torch.bfloat16), is_first_microbatch=False)


E4 = g8.DelayedScaling(amax_history_len=4, fp8_format=g8.Format.E4M3)


def test_fp8_state_of_another_format_is_refused_not_moved():
    """Issue 39: a HYBRID checkpoint loaded into a module running E4M3 (same history length) was
    taken, and the first backward ran on E5M2's gradient scales, saturating E4M3 gradients. Now
    the load refuses, changing nothing; a module that adopted the checkpoint's state (it had
    none) refuses the E4M3 forward before it runs; fresh state and the same format still move."""
    hybrid = _ran(H4, 1).state_dict()
    m = _ran(E4, 2)
    before = _everything(m)
    with pytest.raises(ValueError, match=r"holds fp8_format=HYBRID scales, and E4M3 would run"):
        m.load_state_dict(hybrid)
    _assert_unchanged(m, before, "a refused load")
    fresh = build("Linear")
    fresh.load_state_dict(hybrid)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"use the recipe of that state, or start from fresh"):
        with g8.fp8_autocast(recipe=E4):
            fresh(x, is_first_microbatch=True)
    assert fresh.fp8_meta.recipe == H4
    with g8.fp8_autocast(recipe=E4):
        build("Linear")(x, is_first_microbatch=True)
    with g8.fp8_autocast(recipe=H4):
        fresh(x, is_first_microbatch=True)


def _mixed_checkpoint(model_fn):
    """A trained model's state dict whose last FP8 layer holds another history length's state;
    returns (the model to load into, that state dict)."""
    src, other = model_fn(H4), model_fn(H16)
    state = src.state_dict()
    last = [k for k in state if k.endswith("_extra_state")][-1]
    state[last] = other.state_dict()[last]
    return model_fn(H4, seed=5), state


def _seq(recipe, seed: int = 3):
    torch.manual_seed(seed)
    model = g8.convert(torch.nn.Sequential(*(torch.nn.Linear(H, H) for _ in range(3))))
    x = torch.randn(T, H, requires_grad=True)
    with g8.fp8_autocast(recipe=recipe):
        model(x).square().sum().backward()
    return model


def _lm(recipe, seed: int = 0):
    from tests.hf.common import batch, hf_model

    lm = g8.from_hf(hf_model(seed=seed).train(), recipe=recipe)
    x = batch(0, 0)
    lm(x, labels=x).loss.backward()
    return lm


@pytest.mark.parametrize("model_fn", [_seq, _lm], ids=["convert", "from_hf"])
def test_a_model_loads_all_or_nothing(model_fn):
    """Issue 39: a checkpoint whose last layer's FP8 state is refused raised after the layers
    before it were loaded (weights and FP8 state): a model loaded half. Now the model's pre-hook
    checks every layer's entry first."""
    model, state = _mixed_checkpoint(model_fn)
    before = _everything(model)
    with pytest.raises(ValueError, match=r"amax_history_len=16"):
        model.load_state_dict(state)
    _assert_unchanged(model, before, "a refused model load")
