"""graphfp8.convert refuses what a graphfp8.Linear cannot keep (issue 25, row 5), naming the
module, before anything changes: the model is converted whole or left exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.modules.common import H, T


class _Scaled(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class _WithBuffer(nn.Linear):  # nn.Linear's forward, but more state than weight and bias
    def __init__(self, *args):
        super().__init__(*args)
        self.register_buffer("mask", torch.ones(self.out_features))


def _forward_hooked(lin):
    lin.register_forward_hook(lambda m, inp, out: out * 2)
    return lin


def _pre_hooked(lin):
    lin.register_forward_pre_hook(lambda m, inp: (inp[0] * 2,))
    return lin


def _weight_norm(lin):
    return nn.utils.parametrizations.weight_norm(lin)


def _old_weight_norm(lin):  # the deprecated one: a forward pre-hook
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nn.utils.weight_norm(lin)


CASES = {
    "subclass with its own forward": (lambda: _Scaled(H, H), "its own forward"),
    "subclass with a buffer": (lambda: _WithBuffer(H, H), r"holds \['mask'\]"),
    "forward hook": (lambda: _forward_hooked(nn.Linear(H, H)), "forward hooks"),
    "forward pre-hook": (lambda: _pre_hooked(nn.Linear(H, H)), "forward pre-hooks"),
    "weight_norm": (lambda: _weight_norm(nn.Linear(H, H)), r"parametrizations of \['weight'\]"),
    "old weight_norm": (lambda: _old_weight_norm(nn.Linear(H, H)), "forward pre-hooks"),
    "LazyLinear": (lambda: nn.LazyLinear(H), "uninitialised LazyLinear"),
    "Linear(30, 50)": (lambda: nn.Linear(30, 50), r"cannot run in FP8"),
    "Linear(32, 50)": (lambda: nn.Linear(H, 50), "multiples of 16"),
    "float64": (lambda: nn.Linear(H, H, dtype=torch.float64), "torch.float64 parameters"),
}


def _model(bad: nn.Module) -> nn.Sequential:
    """A model whose last layer is `bad`, after layers convert could take (a LayerNorm + Linear
    pair included), so a half-done conversion would show."""
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(H), nn.Linear(H, H), nn.GELU(),
                         nn.Sequential(nn.Linear(H, H), bad))  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_anything_changes(case):
    make, reason = CASES[case]
    model = _model(make())
    before = {name: type(m) for name, m in model.named_modules()}
    params = list(model.parameters())
    with pytest.raises(ValueError, match=rf"3\.1 \(.*\) .*{reason}") as info:
        g8.convert(model)
    assert "nothing was converted" in str(info.value) and "module_filter" in str(info.value)
    assert {name: type(m) for name, m in model.named_modules()} == before, "half-converted"
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))


def test_a_refused_linear_alone_is_named():
    with pytest.raises(ValueError, match=r"the model \(Linear\(30, 50\)\) cannot run in FP8"):
        g8.convert(nn.Linear(30, 50))


def test_every_refusal_is_listed_once():
    shared = nn.Linear(30, 50)
    model = nn.Sequential(shared, nn.Sequential(shared), _Scaled(H, H))
    with pytest.raises(ValueError) as info:
        g8.convert(model)
    text = str(info.value)
    assert text.count("Linear(30, 50)") == 1 and "2 (_Scaled(32, 32)) is a _Scaled" in text


def test_module_filter_leaves_layers_as_they_are():
    model = _model(nn.Linear(H, 50))
    g8.convert(model, module_filter=lambda m, name: name != "3.1")
    assert isinstance(model[1], g8.LayerNormLinear) and isinstance(model[3][0], g8.Linear)
    assert type(model[3][1]) is nn.Linear


def test_a_layernorm_with_a_hook_is_kept_not_fused():
    """Not fused (its hook runs as before); the Linear after it still converts."""
    model = _model(nn.Linear(H, H)).to(torch.bfloat16)
    calls = []
    model[0].register_forward_hook(lambda m, inp, out: calls.append(1))
    x = torch.randn(T, H, dtype=torch.bfloat16)
    want = model(x)
    g8.convert(model)
    assert type(model[0]) is nn.LayerNorm and isinstance(model[1], g8.Linear)
    assert_bitwise_equal(model(x), want)
    assert len(calls) == 2


def test_a_subclass_with_linear_forward_converts():
    """NonDynamicallyQuantizableLinear (nn.MultiheadAttention's out_proj) keeps nn.Linear's
    forward and state: it converts like an nn.Linear."""
    lin = nn.modules.linear.NonDynamicallyQuantizableLinear(H, H)
    model = nn.Sequential(copy.deepcopy(lin))
    g8.convert(model)
    assert isinstance(model[0], g8.Linear)
