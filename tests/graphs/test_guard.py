"""The replay guard on every entry point (make_graphed_callables, make_graphed_microbatch,
make_graphed_step): each change after capture that a graph cannot follow raises before anything
runs, and changes that do not matter to the graphs pass (issue 26)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw
from tests.modules.common import H, Stack, T, fp8_state

RECIPE = g8.DelayedScaling(amax_history_len=4)
N = 2
ENTRY_POINTS = ["callables", "microbatch", "step"]


class Model(Stack):
    """Stack with a buffer that its forward reads and a norm weight frozen before capture."""

    def __init__(self, device):
        super().__init__(device=device)
        self.register_buffer("shift", torch.zeros(H, dtype=torch.bfloat16, device=device))
        self.norm.weight.requires_grad_(False)

    def forward(self, x, is_first_microbatch=None):
        return super().forward(x + self.shift, is_first_microbatch=is_first_microbatch)


def _mse(y, target):
    return F.mse_loss(y.float(), target.float())


def capture(entry: str, device):
    """(model, run): run() makes one training call of the entry point (forward and backward)."""
    model = Model(device)
    x = torch.randn(N, T, H, dtype=torch.bfloat16, device=device)
    target = torch.randn_like(x)
    fp8 = dict(fp8_enabled=True, fp8_recipe=RECIPE, num_warmup_iters=1)
    if entry == "callables":
        g = g8.make_graphed_callables(model, (x[0].clone().requires_grad_(),), **fp8)

        def run():
            _mse(g(x[0].clone().requires_grad_()), target[0]).backward()

    elif entry == "microbatch":
        g = g8.make_graphed_microbatch(model, _mse, (x[0], target[0]), **fp8)

        def run():
            g((x[0], target[0]))

    else:
        opt = adamw([p for p in model.parameters() if p.requires_grad], device)
        g = g8.make_graphed_step(model, _mse, opt, (x, target), N, **fp8)

        def run():
            g((x, target))

    run()
    return model, run


def _state(model):
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return (
        [p.detach().clone() for p in model.parameters()]
        + grads
        + [t.clone() for _, t in fp8_state(model)]
    )


def _replace_param(m):
    m.mlp.fc1_weight = nn.Parameter(m.mlp.fc1_weight.detach().clone())


def _load_assign(m):
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=True)


def _data_swap(m):
    m.proj.weight.data = m.proj.weight.data.clone()


def _global_hook(m):
    return nn.modules.module.register_module_forward_pre_hook(lambda *a: None)


CHANGES = {
    "parameter replaced": (_replace_param, r"\['mlp.fc1_weight'\] were replaced"),
    "load_state_dict(assign=True)": (_load_assign, r"\['shift', 'qkv.layer_norm_weight', "),
    "submodule replaced": (lambda m: setattr(m, "act", nn.ReLU()), r"\['act'\] were replaced"),
    "buffer replaced": (lambda m: setattr(m, "shift", m.shift.clone()), r"\['shift'\] were rep"),
    "parameter removed": (lambda m: setattr(m.proj, "bias", None), r"\['proj.bias'\] were rep"),
    ".data swapped": (_data_swap, r"storage of \['proj.weight'\] changed"),
    "module.to(dtype)": (lambda m: m.float(), r"\['shift'\] were replaced"),
    "requires_grad_(False)": (
        lambda m: m.proj.bias.requires_grad_(False),
        r"requires_grad of \['proj.bias \(True -> False\)'\]",
    ),
    "frozen parameter unfrozen": (
        lambda m: m.norm.weight.requires_grad_(True),
        r"requires_grad of \['norm.weight \(False -> True\)'\]",
    ),
    "tensor hook": (
        lambda m: m.mlp.fc2_bias.register_hook(lambda g: g),
        r"tensor hooks .* \['mlp.fc2_bias'\]",
    ),
    "post-accumulate-grad hook": (
        lambda m: m.qkv.weight.register_post_accumulate_grad_hook(print),
        r"tensor hooks .* \['qkv.weight'\]",
    ),
    "forward hook on a submodule": (
        lambda m: m.norm.register_forward_hook(lambda *a: None),
        "hooks were registered on a captured module",
    ),
    "global module hook": (_global_hook, r"hooks were registered .*\(or globally\)"),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_change_after_capture_raises_before_anything_runs(device, entry, change):
    model, run = capture(entry, device)
    make, pattern = CHANGES[change]
    handle = make(model)
    try:
        before = _state(model)
        with pytest.raises(RuntimeError, match=pattern) as err:
            run()
        assert re.search(r"capture (the \w+ )?again", str(err.value))
        for a, b in zip(_state(model), before, strict=True):
            assert_bitwise_equal(a, b, f"{change}: nothing ran")
    finally:
        if hasattr(handle, "remove"):
            handle.remove()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_changes_the_graphs_do_not_depend_on_pass(device, entry):
    model, run = capture(entry, device)
    model.norm.register_forward_hook(lambda *a: None).remove()  # added, then removed
    model.proj.bias.register_hook(lambda g: g).remove()
    other = nn.Linear(4, 4)
    other.weight = nn.Parameter(torch.zeros(4, 4))  # another model's module changed
    model.load_state_dict(model.state_dict())  # in place, without assign
    model.extra = nn.Identity()  # a new submodule that the graphs never run
    run()
    run()
