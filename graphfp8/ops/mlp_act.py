"""The MLP activations and their gradients in the input dtype, no FP8 (csrc/mlp_act.h): the
blockwise LayerNormMLP's activation (fc2 quantizes its output in 1x128 tiles) and backward (fc1's
dgrad quantizes its output), one kernel each, at the copy rate on CUDA.

    gelu    x (rows, F)                 a = gelu_tanh(x)        dx = dy * gelu_tanh'(x)
    swiglu  x = [g | u] (rows, 2 F)     a = silu(g) * u         dx = [dg | du]
    geglu   x = [g | u] (rows, 2 F)     a = gelu_tanh(g) * u    (graphfp8.ops.glu's formulas)

Computed in float32 and rounded once to x's dtype: a is bit for bit the value
graphfp8.ops.blockwise_act quantizes, [dg | du] the value the per-tensor GLU backward casts. The
twins are graphfp8.reference_blockwise.mlp_act / mlp_dact (docs/fp8.md, "Blockwise scaling").
"""

from __future__ import annotations

import torch

from graphfp8.ops._lib import ops, wraps_op

__all__ = ["MLP_ACTIVATIONS", "mlp_act", "mlp_dact"]

MLP_ACTIVATIONS = ("gelu", "swiglu", "geglu")


def _width(x: torch.Tensor, activation: str, what: str) -> int:
    """F, the width of a, after the checks that name the argument (the op checks the rest)."""
    if activation not in MLP_ACTIVATIONS:
        raise ValueError(f"graphfp8.{what}: activation must be one of {MLP_ACTIVATIONS}, got "
                         f"{activation!r}")  # fmt: skip
    if x.dim() != 2:
        raise ValueError(f"graphfp8.{what}: argument 'x' must be 2-D, got {x.dim()}-D")
    return x.shape[1] if activation == "gelu" else x.shape[1] // 2


@wraps_op("mlp_act")
def mlp_act(x: torch.Tensor, activation: str) -> torch.Tensor:
    """a = act(x), the activation of each row.

    Args:
        x: (rows, F) for "gelu", (rows, 2 F) = [g | u] for "swiglu" and "geglu" (fc1's output,
            the gate first); float32/bfloat16/float16, contiguous.
        activation: "gelu" (tanh approximation), "swiglu" or "geglu".

    Returns:
        a (rows, F) in x's dtype.
    """
    out = torch.empty(x.shape[0], _width(x, activation, "mlp_act"), dtype=x.dtype, device=x.device)
    ops.mlp_act(x, activation, out)
    return out


@wraps_op("mlp_dact")
def mlp_dact(dy: torch.Tensor, x: torch.Tensor, activation: str) -> torch.Tensor:
    """dx, the gradient of x for the gradient dy of a = act(x), in one pass.

    Args:
        dy: (rows, F) in x's dtype, contiguous: the gradient of a.
        x: as in `mlp_act`: the forward's input (fc1's output).
        activation: as in `mlp_act`.

    Returns:
        dx, x's shape and dtype: [dg | du] for the gated activations.
    """
    _width(x, activation, "mlp_dact")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ops.mlp_dact(dy, x, activation, out)
    return out
