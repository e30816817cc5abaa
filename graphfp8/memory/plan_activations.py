"""The memory planner's activations: what one microbatch keeps for its backward (per layer, per
recompute mode, and the head's), and the largest working set on top of it, for graphfp8-train's
model (TransformerLayers handing their second residual add on, a norm, a bf16 LM head and a
float32 cross entropy; FP8 GEMMs, attention in bf16).

T tokens per microbatch, H hidden, W = (heads + 2 kv_heads) * head_dim the QKV width, F the
MLP width, F1 fc1's outputs (2 F gated), bytes:

    kept per layer   none       FP8 transposes of norm 1, projection input, norm 2 and act(h):
                                T (3 H + F); bf16 q, k, v 2 T W, attention output 2 T H, the
                                residual sum h 2 T H, fc1's output 2 T F1, the layer's input (the
                                sum its first norm takes) 2 T H; norm statistics, the attention's
                                logsumexp (4 T heads)
                     selective  none less the attention output, its logsumexp and act(h)
                                (the checkpoint keeps the QKV output in place of q, k, v)
                     full       the checkpoint's inputs: x and the residual handed on, 2 T H each
    head             the final norm's input and output 2 T H each (torch's RMSNorm 6 T H more),
                     log_softmax's float32 output 4 T V
    working set      the loss's backward: two float32 (T, V) tensors, 8 T V; or a
                     layer's backward: its recomputed activations (full: all of them) and its
                     gradients' transients 2 T F + 2 T F1 + 10 T H (full: 14 T H), the head's
                     activations freed by then (fitted on the CPU: LiveBytes, within 8%)
    validation       an eager pass without gradients (training/evaluate.py) beside the state:
                     the embedding's output 2 T H and the larger of one layer's forward (what it
                     would keep without recompute, its input and output 4 T H, its weights cast
                     anew into evaluation workspaces, FP8 data and transpose 2 P8 of the layer)
                     and the head's (the final norm 2 T H, torch's RMSNorm 6 T H more; the logits
                     in bf16 and float32 and cross entropy's log-probabilities, 10 T V)
"""

from __future__ import annotations

from graphfp8.memory.shapes import ModelShape

__all__ = [
    "RECOMPUTE",
    "activation_bytes",
    "head_bytes",
    "layer_activation_bytes",
    "layer_working_set_bytes",
    "loss_working_set_bytes",
    "validation_bytes",
    "working_set_bytes",
]

RECOMPUTE = ("none", "selective", "full")


def _norm_stats(shape: ModelShape, tokens: int) -> int:
    """float32 statistics of a layer's two norms (RMSNorm: rstd; LayerNorm: mean and rstd)."""
    return 2 * tokens * 4 * (2 if shape.norm == "LayerNorm" else 1)


def layer_activation_bytes(shape: ModelShape, tokens: int, recompute: str = "none",
                           first: bool = False) -> int:  # fmt: skip
    """Bytes one layer keeps for its backward for `tokens` tokens (first: the model's first
    layer, whose input is the embedding's output and takes no residual)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    t, h, f = tokens, shape.hidden, shape.ffn
    if recompute == "full":
        return 2 * t * h * (1 if first else 2)
    w = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    fp8 = t * (3 * h + f)
    bf16 = 2 * t * (w + h + h + shape.fc1_out + h)
    lse = 4 * t * shape.heads
    kept = fp8 + bf16 + lse + _norm_stats(shape, t)
    if recompute == "selective":
        kept -= 2 * t * h + lse + t * f
    return kept


def head_bytes(shape: ModelShape, tokens: int) -> int:
    """The final norm, the LM head's input and the cross entropy's kept log-probabilities."""
    # torch's RMSNorm (a composite) keeps a float32 copy of its input and its normalized output
    rms = 6 * tokens * shape.hidden if shape.norm == "RMSNorm" else 0
    return 2 * tokens * shape.hidden * 2 + rms + 4 * tokens * shape.vocab + 4 * tokens


def activation_bytes(shape: ModelShape, tokens: int, recompute: str = "none") -> int:
    """Everything one microbatch of `tokens` tokens keeps for its backward."""
    first = layer_activation_bytes(shape, tokens, recompute, first=True)
    rest = (shape.layers - 1) * layer_activation_bytes(shape, tokens, recompute)
    return first + rest + head_bytes(shape, tokens)


def loss_working_set_bytes(shape: ModelShape, tokens: int) -> int:
    """The loss's backward: two float32 (T, V) tensors."""
    return 8 * tokens * shape.vocab


def layer_working_set_bytes(shape: ModelShape, tokens: int, recompute: str = "none") -> int:
    """One layer's backward on top of the kept activations (with what it recomputes), the
    head's activations freed by then."""
    t, h = tokens, shape.hidden
    recomputed = layer_activation_bytes(shape, t) - layer_activation_bytes(shape, t, recompute)
    # a full recompute's layer output (h and y) lives until its backward ends: 4 T H more
    backward = (
        2 * t * shape.ffn + 2 * t * shape.fc1_out + (14 if recompute == "full" else 10) * t * h
    )
    return recomputed + backward - head_bytes(shape, t)


def working_set_bytes(shape: ModelShape, tokens: int, recompute: str = "none") -> int:
    """The largest transient on top of the kept activations: the loss, or one layer's backward
    (with what it recomputes)."""
    return max(loss_working_set_bytes(shape, tokens),
               layer_working_set_bytes(shape, tokens, recompute))  # fmt: skip


def validation_bytes(shape: ModelShape, tokens: int) -> int:
    """An eager validation pass of `tokens` tokens per batch beside the training state."""
    t, h = tokens, shape.hidden
    layer = layer_activation_bytes(shape, t) + 4 * t * h + 2 * shape.fp8_layer_params()
    rms = 6 * t * h if shape.norm == "RMSNorm" else 0
    head = 2 * t * h + rms + 10 * t * shape.vocab
    return 2 * t * h + max(layer, head)
