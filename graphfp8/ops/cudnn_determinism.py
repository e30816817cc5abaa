"""Whether graphfp8's FP8 attention may run under torch.use_deterministic_algorithms(True) on the
GPU: not in training. Two `graphfp8-train --deterministic --fp8-attention` runs on the H200
(2026-12-01) parted at step 48 (graphed) and 49 (eager) at the 1e-5 level, while the same runs
with bf16 attention gave identical bits. The FP8 attention path is the difference (cuDNN's FP8
attention, its backward graph built with use_deterministic_algorithm=True; graphfp8's RoPE casts
around it sum nothing: their amaxes are maxima). So a backward under deterministic algorithms
raises before anything is built or runs (docs/fp8.md), until a GPU run finds what differs. A
forward alone still runs (each output row is one block's fixed-order sums).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["NOT_DETERMINISTIC", "check_deterministic"]

NOT_DETERMINISTIC = (
    "graphfp8: FP8 attention on the GPU is not deterministic: cuDNN's FP8 attention gave "
    "different bits run to run on the H200 (2026-12-01; two graphfp8-train --deterministic "
    "--fp8-attention runs parted at step 48), also with its deterministic backward graph. For "
    "reproducible training use bf16 attention (no fp8_dpa; graphfp8-train without "
    "--fp8-attention), or turn deterministic algorithms off"
)


def check_deterministic(key, backward: bool) -> None:
    """Raises RuntimeError (NOT_DETERMINISTIC) when `key` (a cudnn_sdpa.SdpaKey) asks for a
    deterministic backward that will run (`backward`); under torch's warn_only it warns."""
    if not (backward and key.deterministic):
        return
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(NOT_DETERMINISTIC, stacklevel=3)
        return
    raise RuntimeError(NOT_DETERMINISTIC)
