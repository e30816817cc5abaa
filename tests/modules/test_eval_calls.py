"""An eval-mode call of an FP8 layer (issue 39, item 2) leaves the FP8 training state as it found
it - histories, scales, the weight cache - with is_first_microbatch None or True as with False,
and casts each weight with a scale of its own (a weight changed since training last cast it, as
by a LoRA merge, is not cast with the old weight's scale). Both failed before: an eval call given
None recorded its amaxes, ran the forward update and recast the cached weights with the delayed
scale."""

from __future__ import annotations

import pytest
import torch

import graphfp8 as g8
from graphfp8.testing import assert_bitwise_equal

RECIPE = g8.DelayedScaling(amax_history_len=4)


def _trained(seed: int = 0) -> g8.LayerNormMLP:
    torch.manual_seed(seed)
    layer = g8.LayerNormMLP(64, 128, bias=False, params_dtype=torch.bfloat16)
    for mb in range(2):
        x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
        with g8.fp8_autocast(recipe=RECIPE):
            y = layer(x, is_first_microbatch=mb == 0)
        y.float().square().mean().backward()
    return layer


def _state(layer) -> list[torch.Tensor]:
    meta, cache = layer.fp8_meta, layer.weight_cache
    ws = [t for w in cache.workspaces.values() for t in (w._data, w._transpose, w._scale_inv)]
    return [meta.fwd.history().clone(), meta.fwd.scales().clone(), meta.bwd.history().clone(),
            meta.bwd.scales().clone(), *[t.clone() for t in ws]]  # fmt: skip


@pytest.mark.parametrize("flag", [None, True, False])
def test_an_eval_call_changes_no_fp8_state(flag):
    layer = _trained()
    before = _state(layer)
    layer.eval()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with g8.fp8_autocast(recipe=RECIPE):
        layer(x, is_first_microbatch=flag)
        layer(x * 8, is_first_microbatch=flag)
    for i, (a, b) in enumerate(zip(_state(layer), before, strict=True)):
        assert_bitwise_equal(a, b, f"state tensor {i}")


def test_an_eval_cast_scales_each_weight_from_itself():
    """Weights multiplied by 2**10 after training: the eval output is exactly 2**10 times (each
    GEMM's FP8 bytes unchanged, its scale_inv 2**10 times), where the history's scale saturates."""
    layer = _trained()
    layer.eval()
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.no_grad(), g8.fp8_autocast(recipe=RECIPE):
        base = layer.fc1_weight.detach().clone()
        want = layer(x)
        layer.fc2_weight.data.mul_(2.0**10)
        got = layer(x)
    assert_bitwise_equal(got, want * 2.0**10, "fc2 scaled by 2**10")
    assert torch.equal(layer.fc1_weight, base)
