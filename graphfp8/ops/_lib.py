"""Loads the compiled extension (which registers torch.ops.graphfp8) and its fake kernels."""

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


# Every op only writes into tensors it is given, so the fake (meta) kernels have nothing to do.
@torch.library.register_fake("graphfp8::cast_to_fp8")
def _cast_fake(x, scale, out, scale_inv, amax, noop=None, scaled_max=None):
    return None


@torch.library.register_fake("graphfp8::cast_transpose")
def _cast_transpose_fake(x, scale, out, out_t, scale_inv, amax, noop=None, scaled_max=None):
    return None


@torch.library.register_fake("graphfp8::amax")
def _amax_fake(x, amax, noop=None):
    return None


@torch.library.register_fake("graphfp8::gelu_amax")
def _gelu_amax_fake(x, amax):
    return None


@torch.library.register_fake("graphfp8::dgelu_amax")
def _dgelu_amax_fake(dy, x, amax):
    return None


@torch.library.register_fake("graphfp8::fp8_transpose")
def _transpose_fake(x, out_t, noop=None):
    return None


@torch.library.register_fake("graphfp8::scale_update")
def _scale_update_fake(amax_history, scale, scaled_max, most_recent):
    return None


@torch.library.register_fake("graphfp8::dequantize")
def _dequantize_fake(x, scale_inv, out):
    return None


@torch.library.register_fake("graphfp8::cast_transpose_dbias")
def _cast_transpose_dbias_fake(x, scale, out, out_t, scale_inv, amax, dbias, scaled_max=None):
    return None


@torch.library.register_fake("graphfp8::gelu_cast_transpose")
def _gelu_cast_transpose_fake(x, scale, out, out_t, scale_inv, amax, scaled_max=None):
    return None


@torch.library.register_fake("graphfp8::dgelu_cast_transpose_dbias")
def _dgelu_cast_transpose_dbias_fake(dy, x, scale, out, out_t, scale_inv, amax, dbias,
                                     scaled_max=None):  # fmt: skip
    return None


@torch.library.register_fake("graphfp8::rope_qkv")
def _rope_qkv_fake(qkv, cos, sin, num_heads, inverse, out, num_kv_heads=0):
    return None


@torch.library.register_fake("graphfp8::layernorm_fp8")
def _layernorm_fp8_fake(x, gamma, beta, eps, zero_centered_gamma, scale, out, out_t,
                        scale_inv, amax, mu, rsigma, out_hp=None, residual=None,
                        residual_out=None, scaled_max=None):  # fmt: skip
    return None


@torch.library.register_fake("graphfp8::rmsnorm_fp8")
def _rmsnorm_fp8_fake(x, gamma, eps, zero_centered_gamma, scale, out, out_t, scale_inv, amax,
                      rsigma, out_hp=None, residual=None, residual_out=None,
                      scaled_max=None):  # fmt: skip
    return None


@torch.library.register_fake("graphfp8::layernorm_amax")
def _layernorm_amax_fake(x, gamma, beta, eps, zero_centered_gamma, amax, residual=None):
    return None


@torch.library.register_fake("graphfp8::rmsnorm_amax")
def _rmsnorm_amax_fake(x, gamma, eps, zero_centered_gamma, amax, residual=None):
    return None


@torch.library.register_fake("graphfp8::layernorm_bwd")
def _layernorm_bwd_fake(dy, x, mu, rsigma, gamma, zero_centered_gamma, dx, dgamma, dbeta,
                        dresidual=None):  # fmt: skip
    return None


@torch.library.register_fake("graphfp8::rmsnorm_bwd")
def _rmsnorm_bwd_fake(dy, x, rsigma, gamma, zero_centered_gamma, dx, dgamma, dresidual=None):
    return None


@torch.library.register_fake("graphfp8::rope_fp8")
def _rope_fp8_fake(qkv, cos, sin, num_heads, scale, out, scale_inv, amax, num_kv_heads=0):
    return None


@torch.library.register_fake("graphfp8::rope_fp8_backward")
def _rope_fp8_backward_fake(grads, scale_inv, cos, sin, num_heads, out, num_kv_heads=0):
    return None
