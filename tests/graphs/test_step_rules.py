"""What make_graphed_step refuses, with a clear error before anything changes: another batch
shape, an optimizer it cannot capture, hooks, a loss that syncs with the host (named with its
source line), and changes to the optimizer after capture."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal
from tests.graphs.step_common import adamw
from tests.modules.common import H, T, build

N = 2


def mse(y, target):
    return F.mse_loss(y.float(), target.float())


def _setup(device, fp8=False, make_opt=adamw, **kw):
    model = build("LayerNormMLP", device=device)
    opt = make_opt(model.parameters(), device)
    x = torch.randn(N, T, H, dtype=torch.bfloat16, device=device)
    step = g8.make_graphed_step(model, mse, opt, (x, x.clone()), N, fp8_enabled=fp8,
                                num_warmup_iters=1, **kw)  # fmt: skip
    return model, opt, step, x


def _state(model, opt):
    return [t.clone() for t in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values()
    ]


def _assert_unchanged(before, model, opt):
    for a, b in zip(before, _state(model, opt), strict=True):
        assert_bitwise_equal(b, a)


def test_batch_of_another_shape_or_structure_raises_before_running(device):
    model, opt, step, x = _setup(device)
    before = _state(model, opt)
    bad = torch.randn(N, T + 16, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"batch tensor 0 is \(2, 64, 32\)"):
        step((bad, bad))
    with pytest.raises(ValueError, match="torch.float32"):
        step((x.float(), x))
    with pytest.raises(ValueError, match="1 input and 1 target tensors, called with 2 and 1"):
        step(((x, x), x))
    with pytest.raises(TypeError, match=r"a pair \(inputs, targets\)"):
        step((x, x, x))
    _assert_unchanged(before, model, opt)
    step((x, x))  # the right batch still runs


def test_sample_batch_needs_the_microbatch_dim(device):
    model = build("Linear", device=device)
    x = torch.randn(T, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="holds the 3 microbatches along dim 0"):
        g8.make_graphed_step(model, mse, adamw(model.parameters(), device), (x, x), 3)


@pytest.mark.parametrize(
    "make_opt, error, pattern",
    [
        (lambda p, d: torch.optim.AdamW(p, lr=1e-3), ValueError, "cannot be captured"),
        (lambda p, d: torch.optim.RMSprop(p, lr=1e-3), TypeError, "cannot capture .*RMSprop"),
        (lambda p, d: torch.optim.SGD(p, lr=0.1), ValueError, "fused=True"),
        (lambda p, d: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True), ValueError,
         "run the first optimizer step eagerly"),
        (lambda p, d: adamw(list(p)[:1], d), ValueError, "exactly the model's 2 trainable"),
    ],
)  # fmt: skip
def test_optimizer_that_cannot_be_captured_raises(device, make_opt, error, pattern):
    model = build("Linear", device=device)
    before = [p.clone() for p in model.parameters()]
    x = torch.randn(N, T, H, dtype=torch.bfloat16, device=device)
    with pytest.raises(error, match=pattern):
        g8.make_graphed_step(model, mse, make_opt(model.parameters(), device), (x, x[..., :64]),
                             N, num_warmup_iters=1)  # fmt: skip
    for p, b in zip(model.parameters(), before, strict=True):
        assert_bitwise_equal(p, b)
        assert p.grad is None


def test_hooks_raise_at_capture_and_at_replay(device):
    model = build("LayerNormMLP", device=device)
    x = torch.randn(N, T, H, dtype=torch.bfloat16, device=device)
    handle = model.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="modules must have no hooks when captured"):
        g8.make_graphed_step(model, mse, adamw(model.parameters(), device), (x, x), N)
    handle.remove()
    for register in (lambda p: p.register_hook(lambda g: g),
                     lambda p: p.register_post_accumulate_grad_hook(lambda p: None)):  # fmt: skip
        handle = register(model.fc1_weight)
        with pytest.raises(RuntimeError, match=r"parameters \['fc1_weight'\] have tensor hooks"):
            g8.make_graphed_step(model, mse, adamw(model.parameters(), device), (x, x), N)
        handle.remove()
    model, opt, step, x = _setup(device)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
    try:
        with pytest.raises(RuntimeError, match=r"\(or globally\) after capture"):
            step((x, x))
    finally:
        handle.remove()
    handle = model.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="after capture"):
        step((x, x))
    handle.remove()
    model.fc1_bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"requires_grad of \['fc1_bias \(True -> False"):
        step((x, x))
    model.fc1_bias.requires_grad_(True)
    step((x, x))  # as captured again: it runs


def test_loss_that_syncs_with_the_host_is_named_and_changes_nothing(device):
    model = build("LayerNormMLP", device=device)
    opt = adamw(model.parameters(), device)
    reference = copy.deepcopy(model)
    x = torch.randn(N, T, H, dtype=torch.bfloat16, device=device)

    def loss_fn(y, target):
        loss = mse(y, target)
        if loss.item() > 1e9:  # the offending line
            loss = loss * 0
        return loss

    with pytest.raises(g8.CaptureError, match=r"test_step_rules.py:\d+ in loss_fn: if loss.item"):
        g8.make_graphed_step(model, loss_fn, opt, (x, x), N, fp8_enabled=True,
                             num_warmup_iters=1)  # fmt: skip
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert_bitwise_equal(p, r)
        assert p.grad is None
    assert all(not v.any() for s in opt.state.values() for v in s.values())


def test_optimizer_changes_after_capture_raise(device):
    model, opt, step, x = _setup(device)
    lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = 1e-4  # a float the graph would never see
    with pytest.raises(RuntimeError, match=r"'lr' changed after capture.*fill_"):
        step((x, x))
    opt.param_groups[0]["lr"] = lr
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(RuntimeError, match="'weight_decay' changed after capture"):
        step((x, x))
    opt.param_groups[0]["weight_decay"] = 0.1
    step((x, x))
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError, match="replaced or extended after capture"):
        step((x, x))


def test_float_learning_rate_becomes_a_device_tensor(device):
    model = build("Linear", device=device)
    kind = dict(capturable=True) if torch.device(device).type == "cuda" else dict(fused=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **kind)
    x = torch.randn(N, T, H, dtype=torch.bfloat16, device=device)
    g8.make_graphed_step(model, mse, opt, (x, torch.randn(N, T, 2 * H, device=device)), N,
                         num_warmup_iters=1)  # fmt: skip
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32
    # On the parameters' device: "cuda" names no index, the tensor's device does (cuda:0).
    assert lr.device == model.weight.device and float(lr) == pytest.approx(1e-3)


def test_other_misuse_raises(device):
    model, opt, step, x = _setup(device, fp8=True)
    with pytest.raises(RuntimeError, match="outside fp8_autocast"):
        with g8.fp8_autocast():
            step((x, x))
    linear = build("Linear", device=device)
    with pytest.raises(TypeError, match="0-d floating-point tensor"):
        g8.make_graphed_step(linear, lambda y, t: y.float(), adamw(linear.parameters(), device),
                             (x, x), N)  # fmt: skip
    with pytest.raises(ValueError, match="must not require grad"):
        g8.make_graphed_step(model, mse, opt, (x.clone().float().requires_grad_(), x), N)
