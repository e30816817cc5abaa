"""Thin typed wrappers over the graphfp8 kernels (torch.ops.graphfp8.*) and the FP8 GEMM."""

from graphfp8.ops._lib import GradWatch, TensorWatch, built_with_cuda
from graphfp8.ops.amax import amax_, dgelu_amax_, gelu_amax_, layernorm_amax_, rmsnorm_amax_
from graphfp8.ops.blockwise_act import BlockAct, blockwise_act
from graphfp8.ops.blockwise_fused import blockwise_quantize
from graphfp8.ops.blockwise_norm import BlockNorm, blockwise_norm
from graphfp8.ops.blockwise_stats import blockwise_stats
from graphfp8.ops.cast import cast_to_fp8, cast_transpose
from graphfp8.ops.cast_fused import (
    cast_transpose_dbias,
    dgelu_cast_transpose_dbias,
    gelu_cast_transpose,
)
from graphfp8.ops.dequantize import dequantize
from graphfp8.ops.gemm import check_gemm_dims, fp8_gemm
from graphfp8.ops.gemm_accumulate import fp8_gemm_accumulate_, fp8_gemm_into_
from graphfp8.ops.glu import dglu_cast_transpose_dbias, glu_cast_transpose
from graphfp8.ops.grad_fold import grad_fold_
from graphfp8.ops.mlp_act import mlp_act, mlp_dact
from graphfp8.ops.norm import NormFP8, layernorm_bwd, layernorm_fp8, rmsnorm_bwd, rmsnorm_fp8
from graphfp8.ops.rope import rope_qkv
from graphfp8.ops.rope_cast import rope_amax_, rope_cast_fits, rope_cast_transpose
from graphfp8.ops.rope_fp8 import rope_fp8, rope_fp8_backward
from graphfp8.ops.scale_update import scale_update_
from graphfp8.ops.sdpa_fp8 import check_sdpa_fp8, sdpa_fp8_backward, sdpa_fp8_forward
from graphfp8.ops.stats import cast_stats, reduce_cast_stats, stats_partials
from graphfp8.ops.transpose import fp8_transpose

__all__ = [
    "BlockAct",
    "BlockNorm",
    "GradWatch",
    "NormFP8",
    "amax_",
    "blockwise_act",
    "blockwise_norm",
    "blockwise_quantize",
    "blockwise_stats",
    "built_with_cuda",
    "cast_to_fp8",
    "cast_transpose",
    "cast_stats",
    "cast_transpose_dbias",
    "dgelu_amax_",
    "dgelu_cast_transpose_dbias",
    "dglu_cast_transpose_dbias",
    "check_gemm_dims",
    "check_sdpa_fp8",
    "dequantize",
    "fp8_gemm",
    "fp8_gemm_accumulate_",
    "fp8_gemm_into_",
    "fp8_transpose",
    "gelu_amax_",
    "gelu_cast_transpose",
    "glu_cast_transpose",
    "grad_fold_",
    "layernorm_amax_",
    "layernorm_bwd",
    "layernorm_fp8",
    "mlp_act",
    "mlp_dact",
    "reduce_cast_stats",
    "rmsnorm_amax_",
    "rmsnorm_bwd",
    "rmsnorm_fp8",
    "rope_amax_",
    "rope_cast_fits",
    "rope_cast_transpose",
    "rope_fp8",
    "rope_fp8_backward",
    "rope_qkv",
    "scale_update_",
    "sdpa_fp8_backward",
    "sdpa_fp8_forward",
    "TensorWatch",
    "stats_partials",
]
