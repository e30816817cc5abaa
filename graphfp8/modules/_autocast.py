"""graphfp8 layers under torch.autocast: the autocast dtype is the layer's activation dtype, as
in TransformerEngine.

Inside `torch.autocast(device_type, dtype=D)` (for the input's device) a layer whose parameters
are of another dtype P takes floating inputs of any dtype (cast to P, as autocast casts a
Linear's inputs; exact when D is narrower), and:

- under fp8_autocast it computes in FP8 exactly as without torch.autocast (its torch ops inside
  run with autocast off, so the FP8 path sees the dtypes it was written for), and returns its
  outputs in D (a Float8Tensor hand-off to the next graphfp8 layer keeps its nominal dtype);
- outside fp8_autocast it is an ordinary torch layer, whose torch ops autocast as torch's do,
  and it returns its floating outputs in D too (a TransformerLayer's residual adds in P would
  otherwise return P; TransformerEngine's layers return D either way).

Gradients flow back through the casts in each tensor's own dtype. Outside torch.autocast the
wrapper is one `is_autocast_enabled` call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from graphfp8.fp8.tensor import Float8Tensor
from graphfp8.modules._context import fp8_recipe

__all__ = ["honour_autocast"]

_DEVICE_TYPES = ("cpu", "cuda")  # graphfp8's (torch.is_autocast_enabled raises for "meta")


def _cast(x, dtype: torch.dtype):
    """x in dtype when it is a plain floating tensor of another dtype; tuples element-wise."""
    if isinstance(x, tuple):
        return tuple(_cast(t, dtype) for t in x)
    if (
        isinstance(x, torch.Tensor)
        and not isinstance(x, Float8Tensor)
        and x.is_floating_point()
        and x.dtype != dtype
    ):
        return x.to(dtype)
    return x


def _under_autocast(module, forward: Callable, args, kwargs, device_type: str):
    param = next(module.parameters(), None)
    if param is None:  # nothing to cast to (DotProductAttention): torch's rules apply
        return forward(module, *args, **kwargs)
    args = _cast(args, param.dtype)
    kwargs = {k: _cast(v, param.dtype) for k, v in kwargs.items()}
    recipe = fp8_recipe()
    if recipe is None or not module.uses_fp8(recipe):
        out = forward(module, *args, **kwargs)
    else:
        with torch.autocast(device_type, enabled=False):
            out = forward(module, *args, **kwargs)
    return _cast(out, torch.get_autocast_dtype(device_type))


def honour_autocast(forward: Callable) -> Callable:
    """Wraps an FP8Module subclass's forward(self, inp, ...) with the rules above."""

    @functools.wraps(forward)
    def wrapped(self, *args, **kwargs):
        inp = args[0] if args else None
        kind = inp.device.type if isinstance(inp, torch.Tensor) else None
        if kind in _DEVICE_TYPES and torch.is_autocast_enabled(kind):
            return _under_autocast(self, forward, args, kwargs, kind)
        return forward(self, *args, **kwargs)

    return wrapped
