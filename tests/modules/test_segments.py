"""Packed documents and padding: segment ids (graphfp8.ops.segments) in DotProductAttention and
TransformerLayer - every document computes what it computes alone, in bf16 and in FP8 attention
(the CPU emulation), and graphs replay each call's own ids."""

from __future__ import annotations

import copy

import pytest
import torch

import graphfp8 as g8
from graphfp8 import ops, reference_attention
from graphfp8.ops import cudnn_ragged
from graphfp8.ops.segments import (
    segment_ids_from_cu_seqlens,
    segment_ids_from_lengths,
    segment_mask,
)
from graphfp8.testing import assert_bitwise_equal, sqnr
from graphfp8.training.determinism import deterministic
from tests.helpers import CUDA_PARAM, DEVICES
from tests.modules.attention_common import DPA, MHA, layer_and_input
from tests.ops.attention_data import backward_scales, forward_case, quantized

BOUNDS = [(0, 5), (5, 11), (11, 16)]  # three documents in a row of 16


def _segments(batch: int, seq: int, device, bounds=BOUNDS) -> torch.Tensor:
    ids = torch.zeros(batch, seq, dtype=torch.int64, device=device)
    for i, (lo, hi) in enumerate(bounds):
        ids[:, lo:hi] = i
    ids[1:] = ids[1:].flip(-1).max() - ids[1:].flip(-1)  # other rows: other boundaries
    return ids


def test_masks_and_conversions():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = segment_mask(ids)[0, 0]
    assert mask.tolist()[3] == [False, False, True, True, False, False]
    assert bool(mask.diagonal().all())
    cu = torch.tensor([0, 2, 5, 6, 9], dtype=torch.int32)  # 2 rows of 6 tokens, flattened
    ids2 = segment_ids_from_cu_seqlens(cu, 2, 6)
    assert ids2.tolist() == [[1, 1, 2, 2, 2, 3], [4, 4, 4, 5, 5, 5]]
    lengths = torch.tensor([3, 6])
    assert segment_ids_from_lengths(lengths, 6).tolist() == [[0, 0, 0, 1, 1, 1], [0] * 6]


def _attention_per_document(a, q, k, v, ids):
    """a's output computed document by document, each document alone."""
    out = torch.empty(*q.shape[:2], q.shape[2] * q.shape[3], dtype=q.dtype, device=q.device)
    for b in range(q.shape[0]):
        for seg in ids[b].unique():
            cols = (ids[b] == seg).nonzero().flatten()
            lo, hi = int(cols[0]), int(cols[-1]) + 1
            out[b : b + 1, lo:hi] = a(q[b : b + 1, lo:hi], k[b : b + 1, lo:hi], v[b : b + 1, lo:hi])
    return out


@pytest.mark.parametrize("groups", [2, 1])
def test_bf16_attention_stays_in_each_document(groups):
    a = g8.DotProductAttention(2, 16, num_gqa_groups=groups)
    q = torch.randn(2, 16, 2, 16, dtype=torch.float32)
    k, v = (torch.randn(2, 16, groups, 16) for _ in "kv")
    ids = _segments(2, 16, "cpu")
    torch.testing.assert_close(
        a(q, k, v, segment_ids=ids), _attention_per_document(a, q, k, v, ids)
    )


def test_padding_leaves_the_valid_tokens_as_without_it():
    a = g8.DotProductAttention(2, 16)
    q, k, v = (torch.randn(2, 16, 2, 16) for _ in "qkv")
    ids = segment_ids_from_lengths(torch.tensor([10, 16]), 16)
    got = a(q, k, v, segment_ids=ids)
    torch.testing.assert_close(got[0, :10], a(q[:1, :10], k[:1, :10], v[:1, :10])[0])
    assert torch.isfinite(got).all()  # padding attends to padding: no empty softmax row


def test_fp8_emulation_matches_twin_with_segments():
    """The CPU FP8 attention op with segment ids against the float64 twin, forward and
    backward, with the CPU floors of tests/ops/test_sdpa_fp8.py (GQA: 2 heads, 1 kv head)."""
    q, k, v, scales, attn_scale = forward_case((2, 16, 2, 1, 16), torch.float8_e4m3fn, "cpu")
    ids = _segments(2, 16, "cpu")
    amax = [torch.zeros(1), torch.zeros(1)]
    o, stats = ops.sdpa_fp8_forward(q, k, v, scales, *amax, attn_scale, segment_ids=ids)
    want = reference_attention.sdpa_fp8_forward(q, k, v, scales, attn_scale, segment_ids=ids)
    assert sqnr(want["o"].float(), o.float()) >= 40.0
    plain, _ = ops.sdpa_fp8_forward(q, k, v, scales, *amax, attn_scale)
    assert not torch.equal(plain, o), "the segments change the result"
    d_o, descale_do = quantized(o.shape, torch.float8_e5m2, "cpu", torch.Generator().manual_seed(3))
    bwd = backward_scales(q, k, v, o, d_o, stats, scales, attn_scale, torch.float8_e5m2, descale_do)
    grads = ops.sdpa_fp8_backward(q, k, v, o, d_o, stats, bwd, [torch.zeros(1) for _ in range(4)],
                                  attn_scale, segment_ids=ids)  # fmt: skip
    want = reference_attention.sdpa_fp8_backward(q, k, v, o, d_o, stats, bwd, attn_scale,
                                                 segment_ids=ids)  # fmt: skip
    for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
        assert sqnr(want[name].float(), got.float()) >= 30.0, name


@pytest.fixture
def ragged_on(monkeypatch):
    """FP8 attention with segment ids (the emulation on the CPU, cuDNN's ragged graph on a GPU)
    instead of the bf16 attention packed batches take by default."""
    monkeypatch.setattr(cudnn_ragged, "ENABLED", True)


@pytest.mark.parametrize("recipe", [None, DPA], ids=["bf16", "fp8 attention"])
def test_transformer_layer_documents_are_independent(recipe, ragged_on):
    """With packed documents, each document's output is the layer's output on that document
    alone: bit for bit in bf16 except for RoPE's rounding at other absolute positions (the
    scores depend only on relative positions), so to tolerance; in FP8 the scales come from
    the whole batch, so to the SQNR of FP8."""
    m, x = layer_and_input("cpu")
    ids = _segments(x.shape[0], x.shape[1], "cpu")
    with torch.no_grad(), g8.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        packed = m(x, segment_ids=ids)
        for b in range(x.shape[0]):
            for seg in ids[b].unique():
                cols = (ids[b] == seg).nonzero().flatten()
                lo, hi = int(cols[0]), int(cols[-1]) + 1
                alone = m(x[b : b + 1, lo:hi])[0]
                if recipe is None:
                    torch.testing.assert_close(packed[b, lo:hi], alone, rtol=2e-2, atol=2e-2)
                else:
                    assert sqnr(alone.float(), packed[b, lo:hi].float()) > 20.0


class _Packed(torch.nn.Module):
    """A TransformerLayer called with segment ids (as the training loop does)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, is_first_microbatch=None, segment_ids=None):
        return self.layer(x, is_first_microbatch=is_first_microbatch, segment_ids=segment_ids)


@pytest.mark.parametrize("recipe, ragged", [(g8.DelayedScaling(amax_history_len=4), False),
                                            (DPA, True), (MHA, False)],
                         ids=["fp8 gemms", "fp8 attention", "fp8 mha, packed in bf16"])  # fmt: skip
def test_graphed_equals_eager_with_changing_segments(recipe, ragged, monkeypatch):
    """The ids are a graph input: each replay must use the call's own ids (a frozen copy of the
    sample's would give another result)."""
    monkeypatch.setattr(cudnn_ragged, "ENABLED", ragged)
    layer, sample = layer_and_input("cpu")
    eager = _Packed(layer)
    ids = _segments(sample.shape[0], sample.shape[1], "cpu")
    calls = iter([ids, ids.flip(-1), torch.zeros_like(ids), ids.roll(3, dims=1)] * 4)
    graphed_model = g8.make_graphed_callables(
        copy.deepcopy(eager), (sample.clone().requires_grad_(),),
        sample_kwargs={"segment_ids": ids}, fp8_enabled=True, fp8_recipe=recipe,
        fp8_weight_caching=True,
    )  # fmt: skip
    for mb in range(4):
        seg = next(calls)
        x = torch.randn_like(sample)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        with g8.fp8_autocast(recipe=recipe):
            ye = eager(xe, is_first_microbatch=mb == 0, segment_ids=seg)
        yg = graphed_model(xg, is_first_microbatch=mb == 0, segment_ids=seg)
        assert_bitwise_equal(yg, ye, f"microbatch {mb}")
        dy = torch.randn_like(ye)
        ye.backward(dy)
        yg.backward(dy)
        assert_bitwise_equal(xg.grad, xe.grad, f"microbatch {mb} dgrad")


@pytest.mark.skipif(
    not cudnn_ragged.ENABLED,
    reason="GRAPHFP8_CUDNN_RAGGED=1 runs it: its first "
    "H200 run stopped with an illegal instruction (docs/benchmarking.md)",
)
@pytest.mark.parametrize("device", [CUDA_PARAM])
def test_cuda_fp8_attention_with_segments_matches_twin(device):
    """cuDNN's ragged FP8 attention (graphfp8.ops.cudnn_ragged: three documents, then padding
    of its own, GQA) against the float64 twin with the same segments, at the CUDA floors of
    tests/ops/test_sdpa_fp8.py; and the layer runs it with graphs."""
    q, k, v, scales, attn_scale = forward_case((2, 128, 2, 1, 128), torch.float8_e4m3fn, device)
    ids = _segments(2, 128, device, bounds=[(0, 40), (40, 100), (100, 128)])
    ids[0, 120:] = 7  # padding at the end of row 0
    amax = [torch.zeros(1, device=device), torch.zeros(1, device=device)]
    o, stats = ops.sdpa_fp8_forward(q, k, v, scales, *amax, attn_scale, segment_ids=ids)
    want = reference_attention.sdpa_fp8_forward(q, k, v, scales, attn_scale, segment_ids=ids)
    assert sqnr(want["o"].float(), o.float()) >= 35.0
    gen = torch.Generator().manual_seed(3)
    d_o, descale_do = quantized(o.shape, torch.float8_e5m2, device, gen)
    bwd = backward_scales(q, k, v, o, d_o, stats, scales, attn_scale, torch.float8_e5m2, descale_do)
    amaxes = [torch.zeros(1, device=device) for _ in range(4)]
    grads = ops.sdpa_fp8_backward(q, k, v, o, d_o, stats, bwd, amaxes, attn_scale, segment_ids=ids)
    want = reference_attention.sdpa_fp8_backward(q, k, v, o, d_o, stats, bwd, attn_scale,
                                                 segment_ids=ids)  # fmt: skip
    for name, got in zip(("dq", "dk", "dv"), grads, strict=True):
        assert sqnr(want[name].float(), got.float()) >= 33.0, name
    layer, sample = layer_and_input(device, groups=1)
    g8.make_graphed_callables(layer, (sample.requires_grad_(),),
                              sample_kwargs={"segment_ids": _segments(*sample.shape[:2], device)},
                              fp8_enabled=True, fp8_recipe=DPA)  # fmt: skip
    x = torch.randn_like(sample).requires_grad_()
    layer(x, segment_ids=ids[:, : sample.shape[1]]).float().sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [DPA, MHA], ids=["dpa", "mha"])
def test_packed_batches_take_bf16_attention_while_ragged_is_off(device, recipe, monkeypatch):
    """With the ragged switch off (the default), a packed batch under fp8_dpa computes exactly
    what the layer computes without fp8_dpa - bf16 attention with the segment mask, FP8 GEMMs -
    and the attention's FP8 state is never allocated."""
    monkeypatch.setattr(cudnn_ragged, "ENABLED", False)
    layer, sample = layer_and_input(device, groups=1)
    plain = copy.deepcopy(layer)
    ids = _segments(*sample.shape[:2], device)
    outs = []
    for m, r in ((layer, recipe), (plain, g8.DelayedScaling(amax_history_len=4))):
        x = sample.clone().requires_grad_()
        # on the GPU torch's masked SDPA backward repeats its bits only when asked to
        with deterministic(device != "cpu"), g8.fp8_autocast(recipe=r):
            y = m(x, segment_ids=ids)
            y.float().square().sum().backward()
        outs.append((y, x.grad))
    assert_bitwise_equal(outs[0][0], outs[1][0], "output")
    assert_bitwise_equal(outs[0][1], outs[1][1], "dgrad")
    assert layer.core_attention.fp8_meta is None


@pytest.mark.parametrize("device", [CUDA_PARAM])
def test_cuda_fp8_attention_op_with_segments_raises_while_switched_off(device, monkeypatch):
    """Called directly, the FP8 attention op with segment ids on the GPU raises before anything
    runs while the ragged switch is off."""
    monkeypatch.setattr(cudnn_ragged, "ENABLED", False)
    q, k, v, scales, attn_scale = forward_case((2, 128, 2, 1, 128), torch.float8_e4m3fn, device)
    amax = [torch.zeros(1, device=device), torch.zeros(1, device=device)]
    with pytest.raises(NotImplementedError, match="switched off"):
        ops.sdpa_fp8_forward(
            q, k, v, scales, *amax, attn_scale, segment_ids=_segments(2, 128, device)
        )
    assert float(amax[0].sum() + amax[1].sum()) == 0.0


def test_ragged_switch_message(monkeypatch):
    monkeypatch.setattr(cudnn_ragged, "ENABLED", False)
    with pytest.raises(NotImplementedError, match=r"bf16 attention.*GRAPHFP8_CUDNN_RAGGED=1"):
        cudnn_ragged.check_enabled("x")
    monkeypatch.setattr(cudnn_ragged, "ENABLED", True)
    cudnn_ragged.check_enabled("x")


def test_bad_segment_ids():
    m, x = layer_and_input("cpu")
    with pytest.raises(ValueError, match=r"segment_ids must be an integer \(batch, seq\)"):
        m(x, segment_ids=torch.zeros(x.shape[:2]))
    with pytest.raises(ValueError, match=r"segment_ids must be an integer \(batch, seq\)"):
        m(x, segment_ids=torch.zeros(1, x.shape[1], dtype=torch.int64))
