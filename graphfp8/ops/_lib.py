"""Loads the compiled extension, which declares torch.ops.graphfp8 (each op beside its C++ entry
point, csrc/ops/), and gives each op's Python wrapper the decorator that registers its fake."""

from __future__ import annotations

import torch

try:
    from graphfp8 import _C
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "graphfp8._C is not built. Run `make build` (or `pip install --no-build-isolation -e .`) "
        f"in the repository first. ({exc})"
    ) from exc

ops = torch.ops.graphfp8


def built_with_cuda() -> bool:
    """Whether the extension holds the CUDA kernels."""
    return bool(_C.built_with_cuda())


# The per-call guard of the graphs (csrc/ops/guard_ops.cpp; graphs/replay_guard.py, grads.py):
# graphs/ reaches the extension through this loader too.
TensorWatch = _C.TensorWatch
GradWatch = _C.GradWatch


def _writes_only(*args, **kwargs) -> None:
    return None


def wraps_op(name: str):
    """Decorator of the Python wrapper of op `name`: registers the op's fake beside the wrapper
    and marks the wrapper (`graphfp8_op`; tests/ops/test_op_registry.py checks one per op).
    Every graphfp8 op returns nothing and writes only into tensors its caller passes in (schema
    `-> ()`, each written argument marked `(a!)`): under FakeTensorMode (torch.compile) it has
    nothing to compute, shapes and dtypes are the caller's, so its fake does nothing.

    Args:
        name: the op, in torch.ops.graphfp8.
    """
    schema = getattr(ops, name).default._schema
    if schema.returns:
        raise TypeError(f"graphfp8.ops.wraps_op: {schema.name} returns {schema.returns}: an op "
                        "that returns something needs a fake of its own")  # fmt: skip
    torch.library.register_fake(f"graphfp8::{name}")(_writes_only)

    def mark(wrapper):
        wrapper.graphfp8_op = name
        return wrapper

    return mark
