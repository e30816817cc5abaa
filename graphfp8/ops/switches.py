"""Switches between CUDA kernel variants (csrc/ops/switches.h): a new kernel lands off until it
has run on a GPU; all below but NORM_BWD_STAGED, NORM_FWD_TRANSPOSE and ROPE_CAST_BWD ran in the
CUDA suite on the H200 (2026-12-01; NORM_BWD_V2, BLOCK_QUANTIZE_STAGED, GLU_V2 and GLU_V2_DIV
2026-12-02) and are on by default.
ENV_DEFAULTS holds the switches that Python modules read once from the environment instead.

Each switch starts from its environment variable (GRAPHFP8_<NAME>=0 turns it off, read once when
the extension loads) and can be flipped at run time, which is how the CUDA tests compare a new
kernel with the one it replaces in one process. docs/benchmarking.md lists them.

    NORM_BWD_BATCHED   the norm backward with several rows in flight per block and the fast
                       fixed-order parameter-gradient reduction (bit-identical results)
    PAIRED_QUANTIZE    the cast-transposes' FP8 conversion two values per instruction and
                       word-wide transposed stores (bit-identical results)
    DBIAS_IN_KERNEL    the fused dbias's column sums by the last block of each column of
                       tiles, not a second kernel: one launch fewer (bit-identical results)
    NORM_BWD_STAGED    (off: 0.94-1.02x the batched kernel) the batched norm backward with each
                       thread's next rows staged in shared memory by cp.async (bit-identical)
    NORM_BWD_PARAM_IN_KERNEL only while NORM_BWD_STAGED is on: dgamma, dbeta summed by the
                       staged kernel's last blocks, not a second kernel (bit-identical results)
    ROPE_PARTS_BWD     the bf16 attention path's RoPE backward reads dq, dk, dv in one
                       kernel instead of a cat and rope_qkv (bit-identical; the CPU always does)
    NORM_FWD_TRANSPOSE (off until it runs on a GPU) the norm forward writes the FP8 transpose
                       from its own kernel (a band of rows staged in shared memory), not a
                       second pass over its FP8 output (bit-identical; the CPU always does)
    ROPE_CAST_BWD      (off until it runs on a GPU) TransformerLayer's QKV projection and RoPE
                       as one autograd Function: the backward casts the QKV gradient to FP8
                       from dq, dk, dv, rotating them back in the cast-transpose, without the
                       RoPE backward pass (bit-identical; switches the CPU path too)
    NORM_BWD_V2        (on; H200 2026-12-02) the 16-bit vectorised norm backward at
                       hidden sizes to 4096 with two batches of rows in flight in registers and
                       specialised per-element work (bit-identical to the batched kernel)
    BLOCK_QUANTIZE_STAGED (on; H200 2026-12-02) blockwise_quantize's 1x128 tiles of a
                       16-bit x and x.T by blocks that walk several tiles, the next staged in
                       shared memory by cp.async while one is quantized (bit-identical)
    GLU_V2             (on; H200 2026-12-02) the SwiGLU / GeGLU cast-transposes on vector
                       tiles with paired FP8 converts and word-wide transposed stores of both
                       layouts (csrc/cuda/glu_v2.cuh; bit-identical)
    GLU_V2_DIV         (on; H200 2026-12-02) only while GLU_V2 is on: SwiGLU's divisions
                       written out without a branch per value where the gates allow
                       (csrc/cuda/glu_v2.cuh; bit-identical)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from graphfp8.ops._lib import _C

__all__ = ["ENV_DEFAULTS", "SWITCHES", "env_switch", "kernel_switch", "switch_on"]

SWITCHES = (
    "NORM_BWD_BATCHED",
    "PAIRED_QUANTIZE",
    "DBIAS_IN_KERNEL",
    "NORM_BWD_STAGED",
    "NORM_BWD_PARAM_IN_KERNEL",
    "ROPE_PARTS_BWD",
    "NORM_FWD_TRANSPOSE",
    "ROPE_CAST_BWD",
    "NORM_BWD_V2",
    "BLOCK_QUANTIZE_STAGED",
    "GLU_V2",
    "GLU_V2_DIV",
)

# The switches read from GRAPHFP8_<NAME> by the module that owns them, with their defaults:
#   CURRENT_FUSED  current scaling's fused casts on CUDA (graphfp8.fp8.current)
#   CUDA_GLU       the fused SwiGLU / GeGLU kernels on CUDA (graphfp8.ops.glu)
#   CUDNN_RAGGED   cuDNN's ragged FP8 attention for segment ids on the GPU (ops/cudnn_ragged.py)
#   BLOCKWISE_NORM (off until its CUDA kernel runs on a GPU) LayerNormLinear / LayerNormMLP
#                  under Float8BlockScaling: the norm writes the GEMM's 1x128 tiles itself
#                  (graphfp8/modules/_blockwise_norm.py; both devices)
#   BLOCKWISE_ACT  (off until its CUDA kernel runs on a GPU) LayerNormMLP under
#                  Float8BlockScaling: the GELU / SwiGLU / GeGLU writes fc2's 1x128 tiles
#                  itself (graphfp8/modules/_blockwise_act.py; both devices)
#   BLOCKWISE_GLU_KERNEL (on; its CUDA kernels ran on the H200 2026-12-02) LayerNormMLP /
#                  LayerNormLinear under Float8BlockScaling: the norm and the MLP activation
#                  (forward and backward) as graphfp8 kernels in the input dtype instead of
#                  torch's ops, the GEMMs quantizing their outputs (modules/_blockwise_plain.py)
#   GRAD_FILL_ONE_PASS (off; its CUDA tests passed on the H200, not timed yet) the -0.0 fill
#                  of graphed callables' .grad buffers before the first microbatch
#                  (graphfp8/graphs/grads.py): one fill_ kernel per large buffer (2 bytes per
#                  bf16 element) instead of zero + negate (6 bytes); read at capture, so one
#                  process can capture both (bit-identical)
#   GRAD_FOLD_COPY_FIRST (off; its first H200 run differed from eager: the flag was freed after
#                  capture while the CUDA graphs still used it, kept alive since) graphed
#                  callables fold each large gradient with graphfp8.ops.grad_fold_: a device
#                  flag, set by the accumulator instead of the -0.0 fill, makes the first
#                  microbatch copy and later ones add (4 + 6 bytes per element a step instead of
#                  6 + 6 + 6); read at capture (graphfp8/graphs/grads.py)
#   WGRAD_INTO_GRAD (off until its CUDA tests pass on a GPU) the per-tensor FP8 weight-gradient
#                  GEMM writes the parameter's .grad itself (cuBLASLt C = D = .grad, beta from
#                  device memory: 0 where .grad is None or a graph's step starts, 1 after): no
#                  separate dW, add or -0.0 fill for those weights, eager and graphed alike
#                  (graphfp8/fp8/into_grad.py; read per eager backward and at capture)
# Every default, here and in csrc/ops/switches.h, is one the CUDA suite passed with on a GPU:
# tests/test_switch_defaults.py compares them with tests/data/gpu_verified_switches.json.
ENV_DEFAULTS = {
    "CURRENT_FUSED": True,
    "CUDA_GLU": True,
    "CUDNN_RAGGED": False,
    "BLOCKWISE_NORM": False,
    "BLOCKWISE_ACT": False,
    "BLOCKWISE_GLU_KERNEL": True,
    "GRAD_FILL_ONE_PASS": False,
    "GRAD_FOLD_COPY_FIRST": False,
    "WGRAD_INTO_GRAD": False,
}


def env_switch(name: str) -> bool:
    """The switch `name` of ENV_DEFAULTS as the environment sets it: GRAPHFP8_<name>=0 off, any
    other value on, unset its default."""
    value = os.environ.get("GRAPHFP8_" + name)
    return ENV_DEFAULTS[name] if value is None else value != "0"


def switch_on(name: str) -> bool:
    """Whether the kernel switch `name` (one of SWITCHES) is on."""
    return bool(_C.get_kernel_switch(name))


@contextlib.contextmanager
def kernel_switch(name: str, on: bool = True) -> Iterator[None]:
    """Runs the block with the kernel switch `name` set to `on`, then restores it."""
    before = _C.set_kernel_switch(name, on)
    try:
        yield
    finally:
        _C.set_kernel_switch(name, before)
