"""Graphed == eager, bit for bit, for TransformerLayer with FP8 attention (fp8_dpa, and fp8_mha
with O kept FP8 into the projection): outputs, losses, input and parameter gradients, and every
FP8 history and scale (the attention's slots included) after each of 3 microbatches of 3 steps,
with weight caching on and off - on the CPU replay tape and with CUDA graphs."""

from __future__ import annotations

import pytest

import graphfp8 as g8
from graphfp8.fp8.slots import AttnFwdRole
from tests.graphs.common import train_pair
from tests.modules.attention_common import layer_and_input


def _train_side_by_side(recipe, caching: bool, device, steps: int = 3, mbs: int = 3):
    eager, sample = layer_and_input(device)
    return train_pair(eager, sample, recipe, caching, steps, mbs)


# Caching on and off, fp8_dpa and fp8_mha, both formats, the E4M3 backward under HYBRID: each
# value in one of three cases (the CPU suite's time).
CASES = [(True, True, g8.Format.HYBRID, False), (False, False, g8.Format.E4M3, False),
         (False, True, g8.Format.HYBRID, True)]  # fmt: skip


@pytest.mark.parametrize("caching, mha, fmt, e4m3_bwd", CASES)
def test_graphed_equals_eager_with_fp8_attention(device, caching, mha, fmt, e4m3_bwd):
    recipe = g8.DelayedScaling(fp8_format=fmt, amax_history_len=4, fp8_dpa=True, fp8_mha=mha,
                               fp8_dpa_e4m3_bwd=e4m3_bwd)  # fmt: skip
    eager, graphed_model, graphed = _train_side_by_side(recipe, caching, device)
    meta = graphed_model.core_attention.fp8_meta
    assert meta is not None and meta.fwd.arena is graphed_model.qkv.fp8_meta.fwd.arena
    # The S slot took amaxes: max P is 1 (exp(0) at each row's maximum). Exactly on the CPU;
    # cuDNN exponentiates a scaled, shifted score with the GPU's approximate exp2, and its max
    # P came out between 1 - 2 and 1 + 5 float32 ulps on the H200 (1.0000004768 here).
    s_amax = meta.fwd.history()[:, AttnFwdRole.S].max().item()
    assert s_amax == (1.0 if device == "cpu" else pytest.approx(1.0, abs=1e-6))
    ops_seen = graphed.captured_ops()
    assert "graphfp8::sdpa_fp8_fwd" in ops_seen["forward"]
    assert "graphfp8::rope_fp8" in ops_seen["forward"]
    assert "graphfp8::sdpa_fp8_bwd" in ops_seen["backward"]
    assert "graphfp8::rope_fp8_backward" in ops_seen["backward"]
    if mha:  # O stays FP8 into the projection: no dequantize of it in the forward graph
        assert "graphfp8::dequantize" not in ops_seen["forward"]
