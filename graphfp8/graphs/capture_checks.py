"""Capture-time checks, run before anything runs: the one rule set of what makes a callable or a
model uncapturable (check_capturable: compiled code, a module of a live capture, DDP/FSDP,
hooks), and the checks on what the entry points are given (a module given twice, a backward
under no_grad, sample inputs that alias in ways a graph cannot follow). The options are checked
when graphs/options.py's CaptureOptions is built."""

from __future__ import annotations

import torch
from torch import nn

from graphfp8.fp8.tensor_fsdp import fsdp_module_types
from graphfp8.graphs.compiled import compiled_part
from graphfp8.graphs.fsdp import check_fsdp2_model, fsdp_hook, is_fsdp2, refusal
from graphfp8.graphs.lifecycle import live_owner
from graphfp8.graphs.replay_guard import any_hook, hook_dicts, tensor_hooks

__all__ = ["check_capturable", "check_distinct", "check_grad_mode", "check_inputs_alias",
           "check_no_hooks", "inside_ddp_forward"]  # fmt: skip

_DDP_ADVICE = (
    "a graph folds the gradients into .grad inside itself, so DDP's (or FSDP's) gradient hooks "
    "never run. Capture the plain module and average the gradients with "
    "graphfp8.distributed.allreduce_gradients once per step (make_graphed_step: process_group=), "
    "or shard it the graphed way: masters, gradients and optimizer state with "
    "MasterWeights(model, shard_group=...) (make_graphed_step(master_weights=...))"
)


_ORDER = (
    "capture the plain module and compile around the graphed callable instead: "
    "graphed = make_graphed_callables(module, ...), then torch.compile the model or function "
    "that calls it (dynamo runs the graph replay as one opaque call)"
)


def check_capturable(entry: str, name: str, func, modules, named_params=None,
                     index: int | None = None, fsdp2_ok: bool = False) -> None:  # fmt: skip
    """The rules what an entry point captures must meet, checked in this order, before anything
    runs (all three entry points):

        1. it is not, and holds no, torch.compile'd code: capture first, compile around
           (graphs/compiled.py)
        2. none of its modules replays the graphs of a live capture (graphs/lifecycle.py): its
           capture would record a replay inside another capture
        3. none is a DistributedDataParallel or FSDP wrapper (their gradient hooks never run),
           but for an FSDP2 model given to make_graphed_microbatch (fsdp2_ok), whose hooks the
           capture runs (graphs/fsdp.py checks what it supports)
        4. no module hook, global module hook or parameter tensor hook: Python a graph does not
           run (a plain function's parameters are checked once found: check_no_hooks); with
           fsdp2_ok, FSDP2's own forward hooks are allowed

    Args:
        entry: the entry point.
        name: what is captured, for messages ("graphed callable 0 (Block)", "the model").
        func: the callable or model given.
        modules: its modules (a module's tree, the modules a plain function closes over).
        named_params: its (name, parameter) pairs whose hooks are checked; None: not yet.
        index: a graphed callable's place among the callables (None: the model, and the
            messages of rules 3 and 4 start with `entry`, not `name`).
        fsdp2_ok: the entry point captures FSDP2 models (make_graphed_microbatch).
    """
    what = compiled_part(func)
    if what is not None:
        if index is not None:
            raise TypeError(f"{entry}: graphed callable {index} is {what}; graphing compiled "
                            f"code is not supported: {_ORDER}")  # fmt: skip
        raise TypeError(
            f"{entry}: the model is {what}; graphing compiled code is not supported: capture "
            "the plain model, and torch.compile the code around the graph's call if you like "
            "(dynamo runs the call as one opaque call)"
        )
    modules, prefix = list(modules), name if index is not None else entry
    for m in modules:
        owner = live_owner(m)
        if owner is not None:
            raise RuntimeError(
                f"{entry}: {name} contains {type(m).__name__}, which an earlier "
                "make_graphed_callables already captured (its forward replays that capture's "
                "graphs). Call reset() on the earlier graphed callable to give it its eager "
                "forward back, or capture a copy made before the first capture"
            )
    kinds = _data_parallel_types()
    fsdp2 = any(isinstance(m, kinds[1:2]) for m in modules) or is_fsdp2(func)
    if fsdp2 and not fsdp2_ok:
        raise RuntimeError(refusal(entry))
    if fsdp2:
        kinds = tuple(k for k in kinds if k is not kinds[1])
    found = sorted({type(m).__name__ for m in modules if isinstance(m, kinds)})
    if found:
        raise RuntimeError(f"{prefix}: cannot capture {found[0]}: {_DDP_ADVICE}")
    if fsdp2:
        check_fsdp2_model(entry, func)
    if named_params is not None:
        named = list(named_params)
        check_no_hooks(prefix, modules, [p for _, p in named], [n for n, _ in named],
                       allowed=fsdp_hook if fsdp2 else None)  # fmt: skip


def check_grad_mode(name: str, needs_backward: bool) -> None:
    """Raises if the capture needs a backward (something requires grad) but grad is disabled
    (torch.no_grad(), inference_mode()): the graphs hold the backward, which autograd cannot
    record there. Forward-only captures (nothing requires grad) are fine under no_grad."""
    if needs_backward and not torch.is_grad_enabled():
        raise RuntimeError(
            f"{name}: captured under torch.no_grad() or torch.inference_mode(), but its "
            "graphs hold a backward (parameters or sample inputs require grad), which autograd "
            "cannot record there. Capture with grad enabled"
        )


def _data_parallel_types() -> tuple[type, ...]:
    return (nn.parallel.DistributedDataParallel, *fsdp_module_types())


def inside_ddp_forward(name: str) -> None:
    """Raises if a replay is called from inside a DistributedDataParallel forward (DDP(model)
    around graphed blocks): DDP would wait for gradients its hooks never see (torch reports
    unused parameters at the next step)."""
    if getattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None) is not None:
        raise RuntimeError(f"{name}: called inside DistributedDataParallel's forward; "
                           f"{_DDP_ADVICE}")  # fmt: skip


def check_distinct(callables) -> None:
    """Raises if one module is given twice: its forward cannot replay two captures."""
    seen = {}
    for i, func in enumerate(callables):
        if id(func) in seen and isinstance(func, nn.Module):
            raise ValueError(
                f"make_graphed_callables: callables {seen[id(func)]} and {i} are the same "
                f"{type(func).__name__}; to capture a layer for several microbatches of a "
                "pipeline schedule, pass it once and give order="
            )
        seen[id(func)] = i


def check_no_hooks(name: str, modules, params, param_names, allowed=None) -> None:
    """Raises if the modules (or torch, globally) have module hooks, or the parameters tensor
    hooks: Python that a captured graph would not run. allowed(hook): a module hook the capture
    runs (FSDP2's: graphs/fsdp.py)."""
    carried = [m for m in modules if getattr(m, "_graphfp8_carry", None) is not None]
    if carried:
        raise RuntimeError(
            f"{name}: a model converted with convert(model, recipe=...) carries its recipe "
            f"through forward hooks ({type(carried[0]).__name__}), which a captured graph would "
            "not run: convert it without a recipe and pass the recipe to the capture "
            "(fp8_enabled=True, fp8_recipe=...)"
        )
    if any_hook(hook_dicts(modules), allowed):
        raise RuntimeError(
            f"{name}: modules must have no hooks when captured (module or global module hooks); "
            "a captured graph does not run them"
        )
    hooked = tensor_hooks(params)
    if hooked:
        raise RuntimeError(
            f"{name}: parameters {[param_names[i] for i in hooked]} have tensor hooks "
            "(register_hook, register_post_accumulate_grad_hook); the captured backward folds "
            "gradients into .grad without running them"
        )


def check_inputs_alias(name: str, inputs: list[torch.Tensor]) -> list[int]:
    """How the sample inputs share memory, as a graph can follow it.

    The same tensor at several positions is one static input (its gradient is summed once, as
    eagerly), and later calls must pass one tensor at those positions too. Distinct tensors that
    overlap in memory (x and x[1:]) are refused: the input copies of a replay would overwrite
    each other. Views of one storage that do not overlap (qkv.chunk(3)) are fine.

    Returns:
        alias_of: for each position, the first position that holds the same tensor.
    """
    first: dict[int, int] = {}
    alias_of = [first.setdefault(id(t), i) for i, t in enumerate(inputs)]
    distinct = [inputs[i] for i in sorted(set(alias_of))]
    by_storage: dict[tuple, list[torch.Tensor]] = {}
    for t in distinct:
        if t.numel():
            key = (t.device, t.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append(t)
    for group in by_storage.values():
        if len(group) > 1 and _overlap(group):
            positions = [i for i, t in enumerate(inputs) if any(t is g for g in group)]
            raise ValueError(
                f"{name}: sample arguments {positions} are different tensors that overlap in "
                "memory (views of one storage); a replay copies each into its own static "
                "buffer, so they would overwrite each other. Pass the same tensor at each of "
                "those positions, or tensors that do not overlap"
            )
    return alias_of


def _overlap(views: list[torch.Tensor]) -> bool:
    """Whether any element of one view is an element of another (views of one storage): each
    view marks its bytes in a map of the storage."""
    storage = views[0].untyped_storage()
    marks = torch.zeros(storage.nbytes(), dtype=torch.uint8, device=views[0].device)
    for v in views:
        if v.dtype != views[0].dtype:
            return True  # one storage read as two dtypes: treat as overlapping
        size = v.element_size()
        # The bytes of every element: a (numel, element size) view of the byte map.
        shape, stride = (*v.shape, size), (*(s * size for s in v.stride()), 1)
        region = marks.as_strided(shape, stride, v.storage_offset() * size)
        if region.any():
            return True
        region.fill_(1)
    return False
