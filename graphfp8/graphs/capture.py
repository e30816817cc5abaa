"""make_graphed_callables: capture callables with their FP8 state inside the graphs.

Four phases, as in torch/cuda/graphs.py: warmup, capture of the forwards in order, capture of the
backwards in reverse order (one memory pool), and wrapping each callable in an autograd.Function.
What runs where on every microbatch (one forward replay and one backward replay per callable):

    forward graph of callable 0:  the fused scale update of every forward arena (after the MAX
                                  all-reduce of the amaxes over fp8_group, when given: captured
                                  as a NCCL collective, replayed and waited for by the CPU tape)
    forward graphs:               weight cast-transpose guarded by the device weight-cache flag
                                  (nothing is written when it holds 1), activation casts with
                                  amax, GEMMs
    backward graphs:              grad casts with amax, GEMMs
    backward graph of callable 0  (the last to run): the fused update of every backward arena
    eager, between replays:       input copies (only when the pointer differs), and a fill_ of
                                  the weight-cache flag when is_first_microbatch changes value
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from graphfp8.fp8 import scaling
from graphfp8.fp8.arena_check import check_arenas
from graphfp8.fp8.autocast import CaptureState, capture_state
from graphfp8.fp8.recipe import DelayedScaling
from graphfp8.graphs.backends import capture_stream, new_graph
from graphfp8.graphs.grads import GradFold
from graphfp8.graphs.replay import (
    GraphedFunction,
    GraphedRunner,
    WeightCacheFlag,
    hook_dicts,
)
from graphfp8.modules.base import FP8Module
from graphfp8.profiling import nvtx_range

__all__ = ["make_graphed_callables"]


def make_graphed_callables(
    callables,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    fp8_enabled: bool = False,
    fp8_recipe: DelayedScaling | None = None,
    fp8_weight_caching: bool = False,
    fp8_group=None,
    pool=None,
):
    """Captures callables (modules or functions) into CUDA graphs (GPU) or replay tapes (CPU).

    Args:
        callables: one callable or a tuple of them, run in this order on every microbatch.
        sample_args: a tuple of tensors per callable (a tuple of tuples for several); they become
            the static inputs.
        num_warmup_iters: eager iterations before capture; their FP8 and RNG effects are undone.
        allow_unused_input: let inputs get no gradient.
        sample_kwargs: a dict of tensors per callable (a tuple of dicts for several).
        fp8_enabled: run graphfp8 modules in FP8 inside the graphs.
        fp8_recipe: the DelayedScaling recipe (default recipe when None).
        fp8_weight_caching: guard the weight casts with a device flag driven by the
            is_first_microbatch argument of each call (True/None cast, False reuses the cache).
        fp8_group: torch.distributed group whose ranks MAX-reduce amaxes inside the graphs,
            with every scale update (once per microbatch per direction). Every rank of the
            group must call make_graphed_callables with the same modules and recipe: the ranks
            check this before warmup and raise on every rank otherwise. Gradients are not
            reduced here: call distributed.allreduce_gradients once per optimizer step.
        pool: a memory pool handle shared with other graphs (CUDA).

    Returns:
        The graphed callables, in the shape given. Modules are returned with `forward`
        replaced; each accepts `is_first_microbatch=` and has `captured_ops()` and
        `captured_kernels()`.

    .. warning::
        Outputs are the graph's static buffers: the next replay overwrites them. Clone them to
        keep them.
    .. warning::
        Every later call must pass tensors of the captured shapes, dtypes, devices and
        requires_grad; other inputs raise before anything runs.
    .. warning::
        Call graphed callables outside fp8_autocast: they carry their own scale updates.
    .. warning::
        With fp8_weight_caching, pass is_first_microbatch=True on the first microbatch after
        every optimizer step: the graph recasts the weights only then.
    .. warning::
        Hooks are not captured: modules must have none, at capture or later. Parameter
        gradients are folded into `.grad` inside captured graphs, so parameter hooks (DDP's
        included) do not run for them.
    .. warning::
        A module called in another training mode than it was captured in runs its eager
        forward (torch's rule), outside any graph.
    """
    just_one = not isinstance(callables, tuple)
    if just_one:
        callables, sample_args = (callables,), (sample_args,)
        sample_kwargs = (sample_kwargs,)
    elif sample_kwargs is None:
        sample_kwargs = (None,) * len(callables)
    if not (len(callables) == len(sample_args) == len(sample_kwargs)):
        raise ValueError("make_graphed_callables: need one sample_args entry per callable")
    if fp8_recipe is not None and not isinstance(fp8_recipe, DelayedScaling):
        raise TypeError(f"fp8_recipe must be a graphfp8.DelayedScaling, got {fp8_recipe!r}")
    recipe = (fp8_recipe or DelayedScaling()) if fp8_enabled else None
    runners, device = _prepare(callables, sample_args, sample_kwargs, fp8_enabled,
                               fp8_weight_caching)  # fmt: skip
    capture = CaptureState(weight_cache_flag=runners[0].weight_cache_flag.tensor)
    state = dict(fp8_enabled=fp8_enabled, recipe=recipe, group=fp8_group, capture=capture)
    if fp8_enabled:
        scaling.new_init_group()  # the captured modules never share arenas with other models
        arenas = _init_fp8_modules(callables, recipe, device)
        check_arenas(arenas, fp8_group)  # before warmup: fail fast, on every rank
    with _fp8_and_rng_preserved(recipe, device), nvtx_range("warmup"):
        _warmup(callables, runners, num_warmup_iters, allow_unused_input, state, device)
    arenas = sorted(capture.arenas.values(), key=lambda a: a.serial)
    # Arenas that only plain functions reach are allocated by the warmup; a check inside the
    # capture would record its all_gather (and its host read) into the graph.
    check_arenas(arenas, fp8_group)
    for arena in arenas:
        arena.frozen = True
    if pool is None and device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
    # The CPU tape runs what it records, hence the snapshot. No garbage collection while
    # capturing: a collected graph of an earlier capture frees its memory pool, which a CUDA
    # capture in progress does not allow (seen on the H200 as cudaErrorStreamCaptureInvalidated).
    with _fp8_and_rng_preserved(recipe, device), _gc_paused(), nvtx_range("capture"):
        _capture_forwards(callables, runners, arenas, state, pool, device)
        _capture_backwards(runners, arenas, state, pool, allow_unused_input, device)
    graphed = tuple(_wrap(c, r) for c, r in zip(callables, runners))
    return graphed[0] if just_one else graphed


# Phase 0: static inputs, devices and checks ---------------------------------------------------


def _prepare(callables, sample_args, sample_kwargs, fp8_enabled, caching):
    runners, devices = [], set()
    for i, (func, args, kwargs) in enumerate(zip(callables, sample_args, sample_kwargs)):
        name = f"graphed callable {i} ({type(func).__name__})"
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        kwargs = dict(kwargs or {})
        flat = list(args) + list(kwargs.values())
        for t in flat:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: sample args and kwargs must be tensors, got {type(t)}")
            devices.add(t.device)
        modules, params = [], ()
        if isinstance(func, nn.Module):
            modules = list(func.modules())
            if any(hook_dicts(modules)):
                raise RuntimeError(f"{name}: modules must have no hooks when captured")
            params = tuple(func.parameters())
            devices.update(p.device for p in params)
        runners.append(GraphedRunner(name, flat, list(kwargs), params, modules))
    if len(devices) != 1:
        raise ValueError(
            f"make_graphed_callables: all tensors must be on one device, got {devices}"
        )
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"make_graphed_callables: unsupported device {device}")
    flag_tensor = torch.zeros(1, device=device) if fp8_enabled and caching else None
    flag = WeightCacheFlag(flag_tensor, fp8_enabled, caching)
    for r in runners:
        r.weight_cache_flag = flag
    return runners, device


def _init_fp8_modules(callables, recipe, device) -> list[scaling.Arena]:
    """Allocates the slots of every FP8 module reachable from the callables before the
    snapshot, and returns their arenas in creation order; modules only reached through plain
    functions allocate during warmup."""
    arenas = {}
    for func in callables:
        if isinstance(func, nn.Module):
            for m in func.modules():
                if isinstance(m, FP8Module):
                    meta = m.fp8_init(recipe, device)
                    arenas.update({id(b.arena): b.arena for b in (meta.fwd, meta.bwd)})
    return sorted(arenas.values(), key=lambda a: a.serial)


@contextlib.contextmanager
def _fp8_and_rng_preserved(recipe, device):
    arenas = scaling.live_arenas(recipe) if recipe is not None else []
    snaps = [(a, a.snapshot()) for a in arenas]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seen = {id(a) for a in arenas}
        for arena, snap in snaps:
            arena.restore_(snap)
        for arena in scaling.live_arenas(recipe) if recipe is not None else []:
            if id(arena) not in seen:  # created during the phase: back to fresh slots
                arena.reset_()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


@contextlib.contextmanager
def _gc_paused():
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _call(func, runner: GraphedRunner):
    n_args = len(runner.static_inputs) - len(runner.kwarg_names)
    args = runner.static_inputs[:n_args]
    kwargs = dict(zip(runner.kwarg_names, runner.static_inputs[n_args:]))
    out = func(*args, **kwargs)
    flat, spec = tree_flatten(out)
    for t in flat:
        if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor:
            raise TypeError(f"{runner.name}: outputs must be plain tensors, got {type(t)}")
    return flat, spec


def _grad_targets(runner: GraphedRunner, outputs):
    inputs = [t for t in runner.static_inputs + list(runner.params) if t.requires_grad]
    outs = [o for o in outputs if o.requires_grad]
    return outs, inputs


@contextlib.contextmanager
def _side_stream(device):
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


# Phase 1: warmup ----------------------------------------------------------------------------


def _warmup(callables, runners, iters, allow_unused, state, device) -> None:
    with _side_stream(device), capture_state(**state):
        for _ in range(iters):
            for func, runner in zip(callables, runners):
                flat, _ = _call(func, runner)
                outs, inputs = _grad_targets(runner, flat)
                if outs and inputs:
                    torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs],
                                        allow_unused=allow_unused)  # fmt: skip
                del flat, outs


# Phase 2: capture the forwards in order -------------------------------------------------------


def _capture_forwards(callables, runners, arenas, state, pool, device) -> None:
    fwd_arenas = [a for a in arenas if a.direction == scaling.FORWARD]
    for i, (func, runner) in enumerate(zip(callables, runners)):
        graph = new_graph(device)
        with capture_state(**state), graph.capture(pool):
            if i == 0 and state["fp8_enabled"]:
                scaling.update_(fwd_arenas, state["group"])
            runner.static_outputs, runner.out_spec = _call(func, runner)
        runner.fwd_graph = graph


# Phase 3: capture the backwards in reverse order ----------------------------------------------


def _capture_backwards(runners, arenas, state, pool, allow_unused, device) -> None:
    bwd_arenas = [a for a in arenas if a.direction == scaling.BACKWARD]
    for i in reversed(range(len(runners))):
        runner = runners[i]
        runner.static_grad_outputs = [
            torch.empty_like(o) if o.requires_grad else None for o in runner.static_outputs
        ]
        outs, inputs = _grad_targets(runner, runner.static_outputs)
        grad_outs = [g for g in runner.static_grad_outputs if g is not None]
        graph = new_graph(device)
        fold = GradFold(runner.params, device)
        with capture_state(**state), fold.hooked(), graph.capture(pool):
            grads = ()
            if outs and inputs:
                grads = torch.autograd.grad(outs, inputs, grad_outs, allow_unused=allow_unused)
            fold.finish()
            if i == 0 and state["fp8_enabled"]:
                scaling.update_(bwd_arenas, state["group"])
        runner.bwd_graph = graph
        it = iter(grads)
        runner.static_grad_inputs = [next(it) if t.requires_grad else None
                                     for t in runner.static_inputs]  # fmt: skip
        del grads, it  # the parameters' stand-ins
        runner.accumulator = fold.accumulator(pool)


# Phase 4: wrap ------------------------------------------------------------------------------


def _wrap(func, runner: GraphedRunner):
    def graphed(*args, is_first_microbatch=None, **kwargs):
        flat = runner.check_call(args, kwargs, is_first_microbatch,
                                 full_hook_check=is_first_microbatch is not False)  # fmt: skip
        outs = GraphedFunction.apply(runner, runner.grad_anchor, *flat)
        return runner.outputs(outs)

    def captured_ops() -> dict[str, list[str]]:
        """The dispatcher ops each graph recorded: {'forward': [...], 'backward': [...]}."""
        return {"forward": runner.fwd_graph.op_names, "backward": runner.bwd_graph.op_names}

    def captured_kernels() -> dict[str, list[str]]:
        """What each graph replays: CUDA kernel nodes on the GPU, tape ops on the CPU."""
        return {"forward": runner.fwd_graph.kernels(), "backward": runner.bwd_graph.kernels()}

    if not isinstance(func, nn.Module):
        graphed.captured_ops, graphed.captured_kernels = captured_ops, captured_kernels
        graphed.runner = runner
        return graphed
    training = func.training
    eager_forward = func.forward

    def forward(*args, is_first_microbatch=None, **kwargs):
        if func.training != training:  # torch's rule: other modes run the eager forward
            return eager_forward(*args, **kwargs)
        return graphed(*args, is_first_microbatch=is_first_microbatch, **kwargs)

    func.forward = forward
    func.captured_ops, func.captured_kernels = captured_ops, captured_kernels
    func.graphed_runner = runner
    return func
