"""graphfp8.te's FP8 regions, FP8 weight creation, graph capture and offloading switch, with
TransformerEngine's signatures (old and new argument names), over graphfp8's own.

TE 2.x renamed fp8_autocast(fp8_recipe, fp8_group) to autocast(recipe, amax_reduction_group)
and make_graphed_callables' fp8_enabled / fp8_recipe / fp8_group / fp8_weight_caching to
enabled / recipe / amax_reduction_group / cache_quantized_params; both spellings work here, and
giving both of a pair raises as in TE.
"""

from __future__ import annotations

import contextlib

from graphfp8 import fp8, graphs
from graphfp8.te._args import check_te_args

__all__ = [
    "autocast",
    "fp8_autocast",
    "fp8_model_init",
    "get_cpu_offload_context",
    "make_graphed_callables",
    "quantized_model_init",
]


def _not_calibrating(where: str, calibrating) -> None:
    if calibrating:
        raise NotImplementedError(
            f"graphfp8.te.{where}: calibrating=True (FP8 statistics without FP8 compute) is not "
            "supported by graphfp8; graphfp8.numerics.FP8Stats records the casts of an FP8 run"
        )


def autocast(enabled: bool = True, calibrating: bool = False, recipe=None,
             amax_reduction_group=None, _graph: bool = False):  # fmt: skip
    """TE 2.x's autocast: graphfp8.fp8_autocast(enabled, recipe, fp8_group=amax_reduction_group).
    `_graph` (TE's internal flag for its own capture) must stay False."""
    check_te_args("autocast", {"_graph": _graph}, {"_graph": False})
    return fp8.autocast(enabled, calibrating, recipe, amax_reduction_group)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None,
                 fp8_group=None, _graph: bool = False):  # fmt: skip
    """TE's fp8_autocast (deprecated in TE 2.x for autocast): graphfp8.fp8_autocast."""
    check_te_args("fp8_autocast", {"_graph": _graph}, {"_graph": False})
    _not_calibrating("fp8_autocast", calibrating)
    return fp8.fp8_autocast(enabled, fp8_recipe, fp8_group)


def quantized_model_init(enabled: bool = True, recipe=None,
                         preserve_high_precision_init_val: bool = False):  # fmt: skip
    """TE's quantized_model_init: graphfp8.fp8_model_init (layers made inside hold FP8 weights;
    train them through graphfp8.MasterWeights). preserve_high_precision_init_val is not
    supported (MasterWeights' fp32 masters start from the FP8 values)."""
    check_te_args("quantized_model_init",
                  {"preserve_high_precision_init_val": preserve_high_precision_init_val},
                  {"preserve_high_precision_init_val": False})  # fmt: skip
    return fp8.fp8_model_init(enabled, recipe)


def fp8_model_init(enabled: bool = True, recipe=None,
                   preserve_high_precision_init_val: bool = False):  # fmt: skip
    """TE's fp8_model_init (quantized_model_init's former name)."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)


def _renamed(old_name: str, old, new_name: str, new):
    """The value of an argument TE renamed: either spelling, not both (TE's ValueError)."""
    if old is not None and new is not None:
        raise ValueError(
            f"make_graphed_callables has deprecated `{old_name}` kwarg in favor of `{new_name}`, "
            "but both kwargs are set."
        )
    return new if old is None else old


def _flags(enabled) -> bool | tuple:
    """TE's `enabled`: one flag, or a tuple of one bool per callable (TE since 2.7), which
    graphfp8.make_graphed_callables takes as it is (and checks: its length, bools only)."""
    return enabled if isinstance(enabled, tuple) else bool(enabled)


_GRAPH_TE_ONLY = {
    "_num_layers_per_chunk": None,
    "retain_graph_in_backward": False,
    "_reuse_graph_input_output_buffers": False,
    "clone_param_grads_on_return": True,
    "pre_warmup_hook": None,
    "post_warmup_hook": None,
    "capture_time_hooks": None,
}


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, sample_kwargs=None,
                           fp8_enabled=None, fp8_calibrating=None, fp8_recipe=None,
                           fp8_group=None, fp8_weight_caching=None, enabled=None,
                           calibrating=None, recipe=None, amax_reduction_group=None,
                           cache_quantized_params=None, _order=None, pool=None,
                           **te_only):  # fmt: skip
    """TE's make_graphed_callables: graphfp8.make_graphed_callables (`_order` is its `order`,
    a pipeline schedule in TE's convention). Parameter gradients are added to `.grad` inside
    the graphs (what TE's default clone_param_grads_on_return=True gives the caller too)."""
    check_te_args("make_graphed_callables", te_only, _GRAPH_TE_ONLY)
    enabled = _flags(_renamed("fp8_enabled", fp8_enabled, "enabled", enabled))
    _not_calibrating(
        "make_graphed_callables", _renamed("fp8_calibrating", fp8_calibrating, "calibrating",
                                           calibrating)
    )  # fmt: skip
    caching = _renamed("fp8_weight_caching", fp8_weight_caching, "cache_quantized_params",
                       cache_quantized_params)  # fmt: skip
    return graphs.make_graphed_callables(
        modules, sample_args, num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input, sample_kwargs=sample_kwargs,
        fp8_enabled=enabled, fp8_recipe=_renamed("fp8_recipe", fp8_recipe, "recipe", recipe),
        fp8_weight_caching=bool(caching),
        fp8_group=_renamed("fp8_group", fp8_group, "amax_reduction_group", amax_reduction_group),
        pool=pool, order=_order,
    )  # fmt: skip


def get_cpu_offload_context(enabled: bool = False, num_layers: int | None = 1,
                            model_layers: int = 1, offload_activations: bool = True,
                            offload_weights: bool = False, double_buffering: bool = False,
                            manual_synchronization: bool = False,
                            retain_pinned_cpu_buffers: bool = False,
                            offload_stream=None):  # fmt: skip
    """TE's activation offloading switch. graphfp8 has no activation offloading: enabled=False
    returns what TE returns then (a null context and an identity sync function, and None for
    the manual controller with manual_synchronization=True); enabled=True raises."""
    if enabled:
        raise NotImplementedError(
            "graphfp8.te.get_cpu_offload_context: enabled=True (offloading activations to CPU "
            "memory) is not supported by graphfp8"
        )
    if manual_synchronization:
        return contextlib.nullcontext(), _identity, None
    return contextlib.nullcontext(), _identity


def _identity(x):
    return x
