"""graphfp8.te.recipe: TransformerEngine's recipe module (transformer_engine.common.recipe) over
graphfp8's recipes.

`DelayedScaling(...)`, `Float8CurrentScaling(...)` and `Float8BlockScaling(...)` take TE's
arguments and return graphfp8's own frozen recipe (graphfp8.DelayedScaling /
graphfp8.Float8CurrentScaling / graphfp8.Float8BlockScaling), so a recipe made either way is the
same value: equal, checkpointed and captured alike. `isinstance(r, te.recipe.DelayedScaling)`
holds for graphfp8's recipe. A TE recipe argument graphfp8 does not implement raises unless it
has TE's default; TE's other recipes (MXFP8, NVFP4, custom) are not here.
"""

from __future__ import annotations

import enum
import os

from graphfp8 import fp8 as _fp8
from graphfp8.te._args import FIXED, check_te_args


class Format(enum.Enum):
    """TE's Format. E4M3 and HYBRID are graphfp8.Format's (a recipe made with either holds
    graphfp8's member); E5M2 (every tensor in E5M2) is not implemented: a recipe made with it
    raises, saying so."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


def _graphfp8_format(fp8_format, where: str):
    """graphfp8.Format of a TE (or graphfp8) format; anything else goes to graphfp8's recipe,
    which refuses it."""
    if fp8_format is Format.E5M2:
        raise NotImplementedError(
            f"graphfp8.te.recipe.{where}: fp8_format=Format.E5M2 (E5M2 for every tensor) is not "
            "implemented by graphfp8, which runs Format.HYBRID (E4M3 forward, E5M2 gradients) "
            "and Format.E4M3: use Format.HYBRID"
        )
    return _fp8.Format(fp8_format.value) if isinstance(fp8_format, Format) else fp8_format


__all__ = ["DelayedScaling", "Float8BlockScaling", "Float8CurrentScaling", "Format", "Recipe"]

Recipe = _fp8.DelayedScaling | _fp8.Float8CurrentScaling | _fp8.Float8BlockScaling
_QUANT_AND_GEMM_PARAMS = (
    "fp8_quant_fwd_inp",
    "fp8_quant_fwd_weight",
    "fp8_quant_bwd_grad",
    "fp8_gemm_fprop",
    "fp8_gemm_dgrad",
    "fp8_gemm_wgrad",
)


class _MakesGraphfp8Recipe(type):
    """isinstance against the TE-named class checks for the graphfp8 recipe it returns."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, cls.graphfp8_class)


class DelayedScaling(metaclass=_MakesGraphfp8Recipe):
    """TE's DelayedScaling(margin, fp8_format, amax_history_len, amax_compute_algo, ...), as a
    graphfp8.DelayedScaling (see its docstring for each field).

    Not supported (raise unless TE's default): scaling_factor_compute_algo (a callable),
    a callable amax_compute_algo, backward_override.
    """

    graphfp8_class = _fp8.DelayedScaling

    def __new__(cls, margin: int = 0, fp8_format: Format = Format.HYBRID,
                amax_history_len: int = 1024, amax_compute_algo: str = "max",
                scaling_factor_compute_algo=None, reduce_amax: bool = True,
                fp8_dpa: bool = False, fp8_mha: bool = False,
                backward_override=None):  # fmt: skip
        check_te_args(
            "recipe.DelayedScaling",
            dict(scaling_factor_compute_algo=scaling_factor_compute_algo,
                 backward_override=backward_override),
            dict(scaling_factor_compute_algo=None, backward_override=None),
        )  # fmt: skip
        fp8_format = _graphfp8_format(fp8_format, "DelayedScaling")
        return _fp8.DelayedScaling(margin=margin, fp8_format=fp8_format,
                                  amax_history_len=amax_history_len,
                                  amax_compute_algo=amax_compute_algo, reduce_amax=reduce_amax,
                                  fp8_dpa=fp8_dpa, fp8_mha=fp8_mha)  # fmt: skip


class Float8CurrentScaling(metaclass=_MakesGraphfp8Recipe):
    """TE's Float8CurrentScaling(fp8_format=...), as a graphfp8.Float8CurrentScaling.

    Not supported (raise unless TE's default): use_power_2_scales, the per-tensor QParams
    (fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad) and GEMM MMParams
    (fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad), fp8_dpa, fp8_mha (FP8 attention is
    DelayedScaling only in graphfp8), backward_override.
    """

    graphfp8_class = _fp8.Float8CurrentScaling

    def __new__(cls, fp8_format: Format = Format.HYBRID, **te_only):
        check_te_args(
            "recipe.Float8CurrentScaling",
            te_only,
            dict(
                use_power_2_scales=False,
                fp8_dpa=False,
                fp8_mha=False,
                backward_override=None,
                **dict.fromkeys(_QUANT_AND_GEMM_PARAMS, FIXED),
            ),
        )
        fp8_format = _graphfp8_format(fp8_format, "Float8CurrentScaling")
        return _fp8.Float8CurrentScaling(fp8_format=fp8_format)


class Float8BlockScaling(metaclass=_MakesGraphfp8Recipe):
    """TE's Float8BlockScaling(fp8_format, x_block_scaling_dim, w_block_scaling_dim,
    grad_block_scaling_dim), as a graphfp8.Float8BlockScaling: power-of-2 scales unless the
    environment sets NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 when the recipe is made (TE's switch).

    Not supported (raise unless TE's default): the QParams (fp8_quant_fwd_inp,
    fp8_quant_fwd_weight, fp8_quant_bwd_grad: their power-of-2 flag follows the environment, as
    TE's defaults do, and amax_epsilon is 0) and MMParams (fp8_gemm_*: the accumulation is
    float32 per block, TE's forced split accumulator), fp8_dpa, fp8_mha, backward_override.
    """

    graphfp8_class = _fp8.Float8BlockScaling

    def __new__(cls, fp8_format: Format = Format.E4M3, x_block_scaling_dim: int = 1,
                w_block_scaling_dim: int = 2, grad_block_scaling_dim: int = 1,
                **te_only):  # fmt: skip
        check_te_args(
            "recipe.Float8BlockScaling",
            te_only,
            dict(fp8_dpa=False, fp8_mha=False, backward_override=None,
                 **dict.fromkeys(_QUANT_AND_GEMM_PARAMS, FIXED)),
        )  # fmt: skip
        fp32_scales = os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
        fp8_format = _graphfp8_format(fp8_format, "Float8BlockScaling")
        return _fp8.Float8BlockScaling(fp8_format=fp8_format,
                                       x_block_scaling_dim=x_block_scaling_dim,
                                       w_block_scaling_dim=w_block_scaling_dim,
                                       grad_block_scaling_dim=grad_block_scaling_dim,
                                       power_2_scale=not fp32_scales)  # fmt: skip
