"""TransformerEngine's arguments that graphfp8.te accepts only at TE's default value, and the
defaults graphfp8.te takes from TE (device, weight initialisation).

A TE argument that graphfp8 does not implement is accepted when it has TE's default value (it
then asks for nothing graphfp8 does not do) and raises NotImplementedError naming it otherwise:
never silently ignored. The tables are TE 2.x's signatures (transformer_engine.pytorch,
2.20); an argument TE does not have at all raises TypeError, as Python would.
"""

from __future__ import annotations

from functools import partial

import torch

__all__ = [
    "FIXED",
    "check_te_args",
    "default_device",
    "default_init",
    "UB",
]


class _Fixed:
    """The default of a TE argument whose every value asks for something graphfp8 does not do
    (TE's quantization and GEMM parameter objects): giving it at all raises."""

    def __repr__(self) -> str:
        return "not given"


FIXED = _Fixed()

# Userbuffers (tensor-parallel communication overlap) flags of the TE layers, all off.
UB = {
    "ub_overlap_ag": False,
    "ub_overlap_rs": False,
    "ub_overlap_rs_dgrad": False,
    "ub_bulk_dgrad": False,
    "ub_bulk_wgrad": False,
    "ub_name": None,
}
# Tensor / sequence parallelism and the wgrad tricks that go with it.
PARALLEL = {
    "sequence_parallel": False,
    "tp_group": None,
    "tp_size": 1,
    "get_rng_state_tracker": None,
    "delay_wgrad_compute": False,
    "symmetric_ar_type": None,
}


def _is_default(value, default) -> bool:
    if default is None or isinstance(default, (bool, _Fixed)):
        return value is default
    if isinstance(default, (int, float)):  # 0 for 0.0 is the default; True for 1 is not
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value == default
    return type(value) is type(default) and value == default


def check_te_args(where: str, given: dict, defaults: dict) -> None:
    """Raises unless every TransformerEngine argument in `given` has TE's default value.

    Args:
        where: the TE name of the callable, e.g. "Linear" or "TransformerLayer.forward".
        given: the TE-only keyword arguments a call received.
        defaults: those arguments' TE defaults; a name not in it is not a TE argument.
    """
    for name, value in given.items():
        if name not in defaults:
            raise TypeError(f"graphfp8.te.{where}: unexpected keyword argument {name!r}")
        if not _is_default(value, defaults[name]):
            raise NotImplementedError(
                f"graphfp8.te.{where}: {name}={value!r} is not supported by graphfp8 (only "
                f"TransformerEngine's default, {defaults[name]!r}); see docs/te.md"
            )


def default_device(device):
    """TE's layers default to the current CUDA device; graphfp8.te's to it when CUDA is
    available, else to the CPU (so TE code runs on a CPU-only machine)."""
    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_init(init_method):
    """TE's default weight initialisation: N(0, 0.023) (biases start at 0)."""
    return init_method or partial(torch.nn.init.normal_, mean=0.0, std=0.023)
