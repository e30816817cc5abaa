"""Shared by the FP8 attention layer tests: recipes, per-device shapes, and a recorder of the
attention's op calls that checks every slot against references computed from the recorded
tensors."""

from __future__ import annotations

import torch

import graphfp8 as g8
from graphfp8 import ops, reference, reference_attention
from graphfp8.fp8.slots import AttnBwdRole, AttnFwdRole
from graphfp8.testing import assert_bitwise_equal
from tests.ops.attention_data import check_amax

DPA = g8.DelayedScaling(amax_history_len=4, fp8_dpa=True)
MHA = g8.DelayedScaling(amax_history_len=4, fp8_dpa=True, fp8_mha=True)


def shape_for(device) -> tuple[int, int, int, int]:
    """(batch, seq, heads, head_dim): small on the CPU; on the GPU a shape cuDNN's FP8
    attention takes on Hopper (head_dim 128, seq 128)."""
    return (2, 16, 2, 16) if torch.device(device).type == "cpu" else (2, 128, 2, 128)


def layer_and_input(device, seed: int = 0, groups: int | None = None):
    """A bf16 TransformerLayer of shape_for(device) (groups: its key/value heads, None = all)
    and an input (batch, seq, hidden)."""
    b, s, h, d = shape_for(device)
    torch.manual_seed(seed)
    m = g8.TransformerLayer(h * d, h, 2 * h * d, max_seq_len=s, params_dtype=torch.bfloat16,
                            device=device, num_gqa_groups=groups)  # fmt: skip
    return m, torch.randn(b, s, h * d, dtype=torch.bfloat16, device=device)


def _snapshot(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_snapshot(v) for v in value]
    return value


class OpRecorder:
    """Wraps graphfp8.ops' attention entry points while active and keeps, per op, the (args,
    result) of its calls, cloned at call time (scales are arena views that move on later)."""

    NAMES = (
        "rope_fp8",
        "sdpa_fp8_forward",
        "sdpa_fp8_backward",
        "rope_fp8_backward",
        "cast_to_fp8",
    )

    def __init__(self) -> None:
        self.calls: dict[str, list] = {n: [] for n in self.NAMES}
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(ops, name)
            self._saved[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                before = _snapshot((args, kwargs))
                result = _original(*args, **kwargs)
                self.calls[_name].append((before, _snapshot(result), (args, result)))
                return result

            setattr(ops, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(ops, name, original)

    def check_forward(self, h0, scale, attn_scale: float, device) -> None:
        """Forward slots: Q, K, V amaxes exact from the rotated bf16 QKV; S and O from the twin
        on the recorded FP8 tensors; scale_invs and descales exact reciprocals."""
        ((qkv, cos, sin, heads, _, kv), _), (parts, scale_inv), _ = self.calls["rope_fp8"][-1]
        b, s, _ = qkv.shape
        rotated = ops.rope_qkv(qkv, cos, sin, heads, num_kv_heads=kv).view(b, s, heads + 2 * kv, -1)
        for i, role in enumerate((AttnFwdRole.Q, AttnFwdRole.K, AttnFwdRole.V)):
            part = rotated.split([heads, kv, kv], dim=2)[i]
            assert_bitwise_equal(h0[role : role + 1], reference.abs_max(part), role.name)
            assert_bitwise_equal(scale_inv[i], torch.reciprocal(scale[role : role + 1]))
        ((q, k, v, scales, *_), _), _, _ = self.calls["sdpa_fp8_forward"][-1]
        for i, t in enumerate((q, k, v)):
            assert_bitwise_equal(t, parts[i])
        assert_bitwise_equal(scales["descale_s"], torch.reciprocal(scale[AttnFwdRole.S :][:1]))
        assert_bitwise_equal(scales["scale_o"], scale[AttnFwdRole.O :][:1])
        want = reference_attention.sdpa_fp8_forward(q, k, v, scales, attn_scale)
        for role, key in ((AttnFwdRole.S, "amax_s"), (AttnFwdRole.O, "amax_o")):
            print(f"{key}: slot {h0[role].item():.6g}, twin {float(want[key]):.6g}")
            check_amax(key, want[key], h0[role], device)

    def check_backward(self, meta, attn_scale: float, device) -> None:
        """Backward slots after the end-of-backward update: the newest history row holds dO's
        amax (exact) and dP, dQ, dK, dV's (the twin on the recorded tensors); each new scale is
        scaled_max / max of the history; every descale is the reciprocal of its scale."""
        newest = meta.bwd.history()[-1]
        call = self.calls["sdpa_fp8_backward"][-1]
        ((q, k, v, o, d_o, stats, scales, *_), _), grads, (raw_args, _) = call
        ptr = raw_args[4].data_ptr()  # the FP8 dO the kernel read: find the cast that wrote it
        casts = [c for c in self.calls["cast_to_fp8"] if c[2][1][0].data_ptr() == ptr]
        assert casts, "no cast_to_fp8 call produced the attention's dO"
        (dy, *_), _ = casts[-1][0]
        assert_bitwise_equal(newest[AttnBwdRole.DO : AttnBwdRole.DO + 1], reference.abs_max(dy))
        assert_bitwise_equal(scales["descale_dp"], torch.reciprocal(scales["scale_dp"]))
        want = reference_attention.sdpa_fp8_backward(q, k, v, o, d_o, stats, scales, attn_scale)
        roles = (AttnBwdRole.DP, AttnBwdRole.DQ, AttnBwdRole.DK, AttnBwdRole.DV)
        for role, key in zip(roles, ("amax_dp", "amax_dq", "amax_dk", "amax_dv"), strict=True):
            print(f"{key}: slot {newest[role].item():.6g}, twin {float(want[key]):.6g}")
            check_amax(key, want[key], newest[role], device)
        ((_, scale_inv, *_), _), _, _ = self.calls["rope_fp8_backward"][-1]
        for si, name in zip(scale_inv, ("scale_dq", "scale_dk", "scale_dv"), strict=True):
            assert_bitwise_equal(si, torch.reciprocal(scales[name]), name)
        history = meta.bwd.history()
        cols = slice(meta.bwd.start, meta.bwd.start + meta.bwd.count)
        want_scale = meta.bwd.arena.scaled_max[cols] / history[1:].amax(dim=0)
        assert_bitwise_equal(meta.bwd.scales(), want_scale)
        assert len(grads) == 3
