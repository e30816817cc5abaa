"""make_graphed_callables: capture callables with their FP8 state inside the graphs.

Four phases, as in torch/cuda/graphs.py: warmup, capture of the forwards in order, capture of the
backwards in reverse order (one memory pool), and wrapping each callable in an autograd.Function.
The callables form units (graphs/schedule.py): without `order`, all of them are one unit run once
per microbatch; with a pipeline `order`, each (chunk, microbatch) is a unit, captured in that
order. What runs where on every microbatch (one forward replay and one backward replay per graph):

    first forward graph of a unit:  the fused scale update of the forward arenas its modules use
                                    (after the MAX all-reduce of the amaxes over fp8_group, when
                                    given: captured as a NCCL collective, replayed and waited for
                                    by the CPU tape)
    forward graphs:                 weight cast-transpose guarded by the device weight-cache flag
                                    (nothing is written when it holds 1), activation casts with
                                    amax, GEMMs
    backward graphs:                grad casts with amax, GEMMs
    last backward graph of a unit:  the fused update of its backward arenas
    eager, between replays:         the checks (inputs, schedule order, what the modules looked
                                    like at capture: graphs/guard.py), input copies (only when
                                    the pointer differs), and a fill_ of the weight-cache flag
                                    when is_first_microbatch changes value
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from graphfp8.fp8 import scaling
from graphfp8.fp8.arena_check import check_arenas
from graphfp8.fp8.autocast import CaptureState, capture_state
from graphfp8.fp8.recipe import DelayedScaling, Recipe
from graphfp8.graphs.backends import new_graph
from graphfp8.graphs.checks import check_distinct, check_options, fp8_modules_of, new_runner
from graphfp8.graphs.compiled import check_not_compiled, compile_set_aside, opaque_to_dynamo
from graphfp8.graphs.contexts import fp8_and_rng_preserved as _fp8_and_rng_preserved
from graphfp8.graphs.contexts import gc_paused as _gc_paused
from graphfp8.graphs.contexts import side_stream as _side_stream
from graphfp8.graphs.discover import adopt_outside_leaves, next_sequence_nr
from graphfp8.graphs.grads import GradFold
from graphfp8.graphs.lifecycle import CapturedGraphs, refuse_deepcopy, undone_on_failure
from graphfp8.graphs.replay import GraphedFunction, GraphedRunner, WeightCacheFlag
from graphfp8.graphs.replay_guard import ReplayGuard, hook_dicts, module_names, owner_modules
from graphfp8.graphs.schedule import Layout
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
    fp8_recipe: Recipe | None = None,
    fp8_weight_caching: bool = False,
    fp8_group=None,
    pool=None,
    order=None,
):
    """Captures callables (modules or functions) into CUDA graphs (GPU) or replay tapes (CPU).

    Args:
        callables: one callable or a tuple of them, run in this order on every microbatch (with
            `order`: the layers of the model chunks, chunk-major).
        sample_args: a tuple of tensors per callable (a tuple of tuples for several; with
            `order`, one per (chunk, microbatch, layer), chunk-major); they become the static
            inputs, and their requires_grad must be that of the real inputs.
        num_warmup_iters: eager iterations before capture (>= 1 with FP8: they find the FP8
            arenas the graphs update); their FP8 and RNG effects are undone.
        allow_unused_input: let inputs get no gradient.
        sample_kwargs: a dict of tensors per callable (a tuple of dicts for several).
        fp8_enabled: run graphfp8 modules in FP8 inside the graphs.
        fp8_recipe: a DelayedScaling or Float8CurrentScaling (DelayedScaling() when None).
        fp8_weight_caching: guard the weight casts with a device flag driven by the
            is_first_microbatch argument of each call (True/None cast, False reuses the cache).
        fp8_group: torch.distributed group whose ranks MAX-reduce amaxes inside the graphs,
            with every scale update (once per microbatch per direction). Every rank of the
            group must call make_graphed_callables with the same modules and recipe: the ranks
            check this before warmup and raise on every rank otherwise. Gradients are not
            reduced here: call distributed.allreduce_gradients once per optimizer step.
        pool: a memory pool handle shared with other graphs (CUDA).
        order: a pipeline schedule, TransformerEngine's convention: +c runs the forward of
            model chunk c (1-based) for its next microbatch, -c its backward (see
            graphs/schedule.py). One graph pair per (chunk, microbatch, layer), captured and
            replayed in this order, each unit's FP8 updates in its own graphs.

    Returns:
        The graphed callables, in the shape given. Modules are returned with `forward`
        replaced (with `order`: one function per (chunk, microbatch, layer), chunk-major, and
        modules keep their forward); each accepts `is_first_microbatch=` and has
        `captured_ops()`, `captured_kernels()` and `reset()`, which frees the graphs of the
        whole capture and gives the modules their eager forward back.

    .. warning::
        Outputs are static buffers that the next replay overwrites: clone them to keep them.
    .. warning::
        Calls follow the captured order: forwards in turn, then backwards in reverse (or
        `order`). A second forward of a callable while the outputs of the first still wait for
        their backward raises, as does any other replay order.
    .. warning::
        Every later call must pass tensors of the captured shapes, dtypes, devices and
        requires_grad; other inputs raise before anything runs.
    .. warning::
        Inside fp8_autocast, graphed callables with FP8 modules must have been captured with
        the region's recipe, fp8_group and enabled flag; otherwise they raise.
    .. warning::
        With fp8_weight_caching, pass is_first_microbatch=True on the first microbatch after
        every optimizer step: the graph recasts the weights only then.
    .. warning::
        After capture, the modules' parameters and buffers, their storage and requires_grad
        stay as captured, and no hooks are added (module, global or parameter tensor hooks):
        each call checks this and raises, saying to recapture. Parameter gradients are folded
        into `.grad` inside captured graphs, so parameter hooks (DDP's included) do not run.
    .. warning::
        A module called in another training mode than captured runs eagerly (torch's rule).
    .. warning::
        Capture first, then torch.compile around the graphed callables (a replay is one opaque
        call to dynamo); a compiled callable raises TypeError (docs/architecture.md).
    """
    just_one = not isinstance(callables, tuple)
    if just_one:
        if order is not None:
            raise ValueError("make_graphed_callables: order needs a tuple of callables")
        callables, sample_args = (callables,), (sample_args,)
        sample_kwargs = (sample_kwargs,)
    elif sample_kwargs is None:
        sample_kwargs = (None,) * len(sample_args)
    if len(sample_args) != len(sample_kwargs) or (
        order is None and len(callables) != len(sample_args)
    ):
        raise ValueError("make_graphed_callables: need one sample_args entry per callable")
    layout = Layout(len(callables), len(sample_args), order)
    check_not_compiled(callables)
    check_options(num_warmup_iters, fp8_enabled, fp8_recipe)
    recipe = (fp8_recipe or DelayedScaling()) if fp8_enabled else None
    funcs = [callables[i] for i in layout.callable_of]
    runners, device = _prepare(callables, sample_args, sample_kwargs, fp8_enabled,
                               fp8_weight_caching, funcs)  # fmt: skip
    graphs = CapturedGraphs(runners, layout, fp8_enabled, recipe, fp8_group, device)
    # Per chunk, so that each chunk's FP8 modules share arenas as they would eagerly, where each
    # chunk's first forward is its own fp8_autocast region.
    chunk_fp8 = [
        [m for j in layout.units[(c, 0)].runners for m in fp8_modules_of(runners[j])]
        for c in range(layout.num_chunks)
    ]
    fp8_modules = _unique(m for chunk in chunk_fp8 for m in chunk)
    capture = CaptureState(weight_cache_flag=runners[0].weight_cache_flag.tensor)
    state = dict(fp8_enabled=fp8_enabled, recipe=recipe, group=fp8_group, capture=capture)
    with undone_on_failure(fp8_modules, runners, callables) as frozen:
        _capture(funcs, runners, layout, chunk_fp8, num_warmup_iters, allow_unused_input,
                 state, pool, device, frozen)  # fmt: skip
        for r in runners:
            r.graphs = graphs
            r.uses_fp8 = bool(r.arenas) or any(isinstance(m, FP8Module) for m in r.modules)
            r.guard = _guard(r, funcs[r.index])
    pairs = zip(funcs, runners, strict=True)
    graphed = tuple(_wrap(f, r, replace_forward=not layout.explicit) for f, r in pairs)
    graphs.register(funcs)
    return graphed[0] if just_one else graphed


def _capture(funcs, runners, layout, chunk_fp8, iters, allow_unused, state, pool, device,
             frozen) -> None:  # fmt: skip
    """Warmup, then the forwards and backwards of each unit in the layout's order. chunk_fp8
    lists the FP8 modules of each chunk; arenas it freezes are appended to `frozen`."""
    recipe, group, capture = state["recipe"], state["group"], state["capture"]
    if state["fp8_enabled"]:
        arenas = []
        for fp8_modules in chunk_fp8:
            scaling.new_init_group()  # the captured modules never share arenas with other models
            arenas += _init_fp8_modules(fp8_modules, recipe, device)
        arenas = sorted(_unique(arenas), key=lambda a: a.serial)
        check_arenas(arenas, group)  # before warmup: fail fast, on every rank
    with _fp8_and_rng_preserved(recipe, device), nvtx_range("warmup"):
        _warmup(funcs, runners, iters, allow_unused, state, device)
    arenas = sorted(capture.arenas.values(), key=lambda a: a.serial)
    # Arenas that only plain functions reach are allocated by the warmup; a check inside the
    # capture would record its all_gather (and its host read) into the graph.
    check_arenas(arenas, group)
    for arena in arenas:
        if not arena.frozen:
            frozen.append(arena)
            arena.frozen = True
    if pool is None and device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
    # The CPU tape runs what it records, hence the snapshot. No garbage collection while
    # capturing: a collected graph of an earlier capture frees its memory pool, which a CUDA
    # capture in progress does not allow (seen on the H200 as cudaErrorStreamCaptureInvalidated).
    with _fp8_and_rng_preserved(recipe, device), _gc_paused(device), nvtx_range("capture"):
        for kind, unit in layout.steps:
            unit_runners = [runners[j] for j in unit.runners]
            used = {k: a for r in unit_runners for k, a in r.arenas.items()}
            unit_arenas = sorted(used.values(), key=lambda a: a.serial)
            if kind == "forward":
                unit_funcs = [funcs[j] for j in unit.runners]
                _capture_forwards(unit_funcs, unit_runners, unit_arenas, state, pool, device)
            else:
                _capture_backwards(unit_runners, unit_arenas, state, pool, allow_unused, device)


# Phase 0: static inputs, devices and checks ---------------------------------------------------


def _prepare(callables, sample_args, sample_kwargs, fp8_enabled, caching, funcs=None):
    """One GraphedRunner per (funcs[j], sample_args[j]) pair (funcs: the callable of each sample,
    the callables themselves by default); returns them and the device."""
    funcs = callables if funcs is None else funcs
    check_distinct(callables)
    runners, devices = [], set()
    for j, (func, args, kwargs) in enumerate(zip(funcs, sample_args, sample_kwargs, strict=True)):
        args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
        kwargs = dict(kwargs or {})
        runner = new_runner(j, func, list(args) + list(kwargs.values()), list(kwargs))
        devices.update(t.device for t in runner.static_inputs)
        devices.update(p.device for p in runner.params)
        runners.append(runner)
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


def _unique(items) -> list:
    return list({id(x): x for x in items}.values())


def _init_fp8_modules(fp8_modules, recipe, device) -> list[scaling.Arena]:
    """Allocates the slots of every FP8 module reachable from the callables (or the modules
    plain functions close over) before the snapshot, and returns their arenas in creation
    order; modules reached otherwise allocate during warmup."""
    arenas = {}
    for m in fp8_modules:
        if m.uses_fp8(recipe):
            meta = m.fp8_init(recipe, device)
            arenas.update({id(b.arena): b.arena for b in (meta.fwd, meta.bwd)})
    return sorted(arenas.values(), key=lambda a: a.serial)


def _call(func, runner: GraphedRunner):
    n_args = len(runner.static_inputs) - len(runner.kwarg_names)
    args = runner.static_inputs[:n_args]
    kwargs = dict(zip(runner.kwarg_names, runner.static_inputs[n_args:], strict=True))
    with compile_set_aside():
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


# Phase 1: warmup ----------------------------------------------------------------------------


def _warmup(callables, runners, iters, allow_unused, state, device) -> None:
    """Runs each callable forward and backward `iters` times. The first iteration finds the
    tensors requiring grad that the outputs depend on beyond the callable's own (adopted as its
    parameters); every one records the FP8 arenas each callable uses in runner.arenas."""
    capture = state["capture"]
    with _side_stream(device), capture_state(**state):
        for it in range(iters):
            for func, runner in zip(callables, runners, strict=True):
                capture.arenas = runner.arenas
                since = next_sequence_nr() if it == 0 else 0
                flat, _ = _call(func, runner)
                if it == 0:
                    adopt_outside_leaves(runner, flat, since)
                outs, inputs = _grad_targets(runner, flat)
                if outs and inputs:
                    torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs],
                                        allow_unused=allow_unused)  # fmt: skip
                del flat, outs
    capture.arenas = {k: a for r in runners for k, a in r.arenas.items()}


# Phase 2: capture the forwards in order -------------------------------------------------------


def _capture_forwards(callables, runners, arenas, state, pool, device) -> None:
    """Captures one unit's forwards in order; the first graph opens with the forward update of
    `arenas` (the unit's)."""
    fwd_arenas = [a for a in arenas if a.direction == scaling.FORWARD]
    capture = state["capture"]
    for i, (func, runner) in enumerate(zip(callables, runners, strict=True)):
        graph = new_graph(device)
        capture.arenas = used = {}
        since = next_sequence_nr()
        with capture_state(**state), graph.capture(pool):
            if i == 0 and state["fp8_enabled"]:
                scaling.update_(fwd_arenas, state["group"])
            runner.static_outputs, runner.out_spec = _call(func, runner)
        runner.fwd_graph = graph
        if used.keys() - runner.arenas.keys():
            raise RuntimeError(
                f"{runner.name}: FP8 modules ran in the capture that did not run while warming "
                "up; a callable must run the same modules every time"
            )
        adopt_outside_leaves(runner, runner.static_outputs, since)


# Phase 3: capture the backwards in reverse order ----------------------------------------------


def _capture_backwards(runners, arenas, state, pool, allow_unused, device) -> None:
    """Captures a unit's backwards in reverse; the last (runners[0]'s) updates the arenas."""
    bwd_arenas = [a for a in arenas if a.direction == scaling.BACKWARD]
    for i in reversed(range(len(runners))):
        runner = runners[i]
        runner.static_grad_outputs = [
            torch.empty_like(o) if o.requires_grad else None for o in runner.static_outputs
        ]
        outs, inputs = _grad_targets(runner, runner.static_outputs)
        grad_outs = [g for g in runner.static_grad_outputs if g is not None]
        graph, inputs_of = new_graph(device), runner.static_inputs
        fold = GradFold(runner.params, device)
        with capture_state(**state), fold.hooked(), graph.capture(pool):
            grads = ()
            if outs and inputs:
                grads = torch.autograd.grad(outs, inputs, grad_outs, allow_unused=allow_unused)
            fold.finish()
            if i == 0 and state["fp8_enabled"]:
                scaling.update_(bwd_arenas, state["group"])
        runner.bwd_graph = graph
        it = iter(grads)  # the inputs' gradients, then the parameters' stand-ins
        runner.static_grad_inputs = [next(it) if t.requires_grad else None for t in inputs_of]
        del grads, it
        runner.accumulator = fold.accumulator(pool)


_RECAPTURE = "call reset() on the graphed callable and capture again"


def _guard(runner: GraphedRunner, func) -> ReplayGuard:
    """What the runner's graphs assume about its modules. A plain function's modules are those it
    closes over whose parameters it was found to use; they must have no hooks either."""
    if runner.closure:
        runner.modules = owner_modules(runner.closure, runner.params)
        if any(hook_dicts(runner.modules)):
            raise RuntimeError(f"{runner.name}: modules must have no hooks when captured")
        roots = [(type(c).__name__, c) for c in runner.closure]
    else:
        roots = [("", func)] if isinstance(func, nn.Module) else []
    owned = {id(p) for m in runner.modules for p in m._parameters.values()}
    outside = [(n, p) for n, p in zip(runner.param_names, runner.params, strict=True)
               if id(p) not in owned]  # fmt: skip
    return ReplayGuard(runner.name, runner.modules, module_names(roots), outside, _RECAPTURE)


# Phase 4: wrap ------------------------------------------------------------------------------


def _wrap(func, runner: GraphedRunner, replace_forward: bool = True):
    """Returns the graphed callable. A module gets its forward replaced (runner.undo puts it
    back at reset()) unless replace_forward is False (pipeline schedules: several graphs per
    module, each returned as a function)."""
    runner.expects_grad = any(g is not None for g in runner.static_grad_outputs) and (
        runner.grad_anchor.requires_grad or any(t.requires_grad for t in runner.static_inputs)
    )

    @opaque_to_dynamo
    def graphed(*args, is_first_microbatch=None, **kwargs):
        flat = runner.check_call(args, kwargs, is_first_microbatch)
        expects_backward = runner.expects_grad and torch.is_grad_enabled()
        outs = GraphedFunction.apply(runner, expects_backward, runner.grad_anchor, *flat)
        return runner.outputs(outs)

    def captured_ops() -> dict[str, list[str]]:
        """The dispatcher ops each graph recorded: {'forward': [...], 'backward': [...]}."""
        return {"forward": runner.fwd_graph.op_names, "backward": runner.bwd_graph.op_names}

    def captured_kernels() -> dict[str, list[str]]:
        """What each graph replays: CUDA kernel nodes on the GPU, tape ops on the CPU."""
        return {"forward": runner.fwd_graph.kernels(), "backward": runner.bwd_graph.kernels()}

    extras = dict(captured_ops=captured_ops, captured_kernels=captured_kernels,
                  reset=runner.graphs.reset)  # fmt: skip
    if not isinstance(func, nn.Module):
        vars(graphed).update(extras, runner=runner)
        return graphed
    training = func.training
    eager_forward = func.forward

    def forward(*args, is_first_microbatch=None, **kwargs):
        if func.training != training:  # torch's rule: other modes run the eager forward
            return eager_forward(*args, **kwargs)
        return graphed(*args, is_first_microbatch=is_first_microbatch, **kwargs)

    if not replace_forward:
        vars(forward).update(extras, runner=runner)
        return forward
    added = dict(extras, forward=forward, graphed_runner=runner,
                 __deepcopy__=refuse_deepcopy(func))  # fmt: skip
    vars(func).update(added)

    def undo() -> None:
        for key in added:
            vars(func).pop(key, None)

    runner.undo = undo
    return func
