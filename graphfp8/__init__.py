"""graphfp8: CUDA-graph-centric FP8 training for PyTorch."""

from graphfp8 import hf, numerics, numerics_blockwise, ops
from graphfp8.distributed import FSDPMasterWeights, MasterWeights, ShardedMasterWeights
from graphfp8.fp8 import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8Tensor,
    Format,
    autocast,
    fp8_autocast,
    fp8_model_init,
    reset_state,
)
from graphfp8.fp8.recompute import recompute
from graphfp8.graphs import (
    CaptureError,
    init_fsdp2,
    make_graphed_callables,
    make_graphed_microbatch,
    make_graphed_step,
)
from graphfp8.hf import from_hf, to_hf
from graphfp8.lora_dispatch import install as _install_lora_dispatch
from graphfp8.modules import (
    DotProductAttention,
    FP8Module,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    TransformerLayer,
    convert,
)

__all__ = [
    "CaptureError",
    "DelayedScaling",
    "DotProductAttention",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "FP8Module",
    "Float8Tensor",
    "FSDPMasterWeights",
    "Format",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MasterWeights",
    "ShardedMasterWeights",
    "TransformerLayer",
    "autocast",
    "convert",
    "fp8_autocast",
    "fp8_model_init",
    "from_hf",
    "hf",
    "init_fsdp2",
    "make_graphed_callables",
    "make_graphed_microbatch",
    "make_graphed_step",
    "numerics",
    "numerics_blockwise",
    "ops",
    "recompute",
    "reset_state",
    "to_hf",
]

# peft loads graphfp8 LoRA adapters without graphfp8.lora.register (graphfp8/lora_dispatch.py).
_install_lora_dispatch()
