"""make_graphed_callables: capture callables with their FP8 state inside the graphs, one graph pair
per callable (per (chunk, microbatch, layer) with a pipeline `order`), replayed through autograd.

The phases (graphs/callable_phases.py) run inside the capture session every entry point shares
(graphs/session.py); the runners are built once at the end and frozen (graphs/runner.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from graphfp8.fp8.main_grad import MainGradSnapshot
from graphfp8.fp8.recipe import Recipe
from graphfp8.fp8.weight_cache import DeviceFlag
from graphfp8.graphs.callable_phases import (
    NAME,
    Sample,
    capture_backwards,
    capture_forwards,
    prepare,
    warmup,
)
from graphfp8.graphs.capture_checks import check_distinct, check_grad_mode, check_no_hooks
from graphfp8.graphs.compiled import opaque_to_dynamo
from graphfp8.graphs.fp8_init import fp8_modules_in, unique
from graphfp8.graphs.fsdp_layers import FSDPLayers, fsdp_layers_of
from graphfp8.graphs.function import GraphedFunction
from graphfp8.graphs.lifecycle import CapturedGraphs, refuse_deepcopy, undone_on_failure
from graphfp8.graphs.options import CaptureOptions
from graphfp8.graphs.replay_guard import ReplayGuard, module_names, owner_modules
from graphfp8.graphs.runner import CallContract, GraphedRunner, GraphPair, InputSpec, storages_of
from graphfp8.graphs.schedule import Layout
from graphfp8.graphs.session import CaptureSession
from graphfp8.graphs.torch_autocast import AutocastState
from graphfp8.modules.base import FP8Module

__all__ = ["make_graphed_callables"]

_RECAPTURE = "call reset() on the graphed callable and capture again"


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
    chain: bool = False,
    fsdp_sync: str = "every",
):
    """Captures callables (modules or functions) into CUDA graphs (GPU) or replay tapes (CPU).

    Args:
        callables: one callable or a tuple of them, run in this order on every microbatch (with
            `order`: the layers of the model chunks, chunk-major).
        sample_args: a tuple of tensors per callable (a tuple of tuples for several; with
            `order`, one per (chunk, microbatch, layer), chunk-major); copies of them become the
            static inputs (the caller's tensors are never written), and their requires_grad
            must be that of the real inputs. One tensor given at several positions is one input
            (its gradient summed once, as eagerly).
        num_warmup_iters: eager iterations before capture (>= 1 with FP8: they find the FP8
            arenas the graphs update); their FP8 and RNG effects are undone.
        allow_unused_input: let inputs get no gradient.
        sample_kwargs: a dict of tensors per callable (a tuple of dicts for several).
        fp8_enabled: run graphfp8 modules in FP8 inside the graphs; or a tuple of one bool per
            callable (TransformerEngine's per-callable fp8_enabled): those given False run in
            their parameter dtype, as eagerly inside fp8_autocast(enabled=False).
        fp8_recipe: a DelayedScaling or Float8CurrentScaling (DelayedScaling() when None); or a
            tuple of one recipe (or None) per callable. Each recipe's modules keep their state in
            that recipe's arenas.
        fp8_weight_caching: guard the weight casts with a device flag driven by the
            is_first_microbatch argument of each call (True/None cast, False reuses the cache);
            False, TransformerEngine's default (graphs/options.py says why the step differs).
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
        chain: callable j+1 is called on callable j's first output (per-layer graphs of a
            stack): each is captured reading the previous one's static output and writing its
            input gradient where the previous backward reads it, so no copy runs between them.
            Not with `order`.
        fsdp_sync: for fully_shard-ed layers (torch FSDP2): "every" backward reduce-scatters
            its gradients (FSDP2's default), or "last": the backward graphs add the unsharded
            gradients into sums and each layer's sync graph reduce-scatters them after a
            backward run with FSDP2's gradient sync on (model.set_requires_gradient_sync(i ==
            last) before each microbatch: gradient accumulation without communication;
            docs/sharding.md).

    Returns:
        The graphed callables, in the shape given. Modules are returned with `forward`
        replaced (with `order`: one function per (chunk, microbatch, layer), chunk-major, and
        modules keep their forward); each accepts `is_first_microbatch=` and has
        `captured_ops()`, `captured_kernels()` and `reset()`, which frees the graphs of the
        whole capture and gives the modules their eager forward back.

    .. warning:: A graph replays what its capture ran: outputs are static buffers, and inputs,
        modules, call order, FP8 and torch.autocast state stay as captured. The rules, each
        checked before anything runs, are in docs/after-capture.md.
    """
    just_one, callables, sample_args, sample_kwargs = _normalize(callables, sample_args,
                                                                 sample_kwargs, order)  # fmt: skip
    layout = Layout(len(callables), len(sample_args), order)
    if chain and layout.explicit:
        raise ValueError(f"{NAME}: chain=True chains the layers of one unit; not with order=")
    options = CaptureOptions(NAME, fp8_enabled, fp8_recipe, fp8_weight_caching, fp8_group,
                             num_warmup_iters, pool, callables=len(callables))  # fmt: skip
    check_distinct(callables)
    funcs = [callables[i] for i in layout.callable_of]
    fsdp = fsdp_layers_of(funcs, order, fsdp_sync)  # FSDP2 layers: graphs/fsdp_layers.py
    samples, device = prepare(funcs, sample_args, sample_kwargs, fsdp)
    for s in samples:
        s.callable_index = layout.callable_of[s.index]
    check_grad_mode(NAME, any(t.requires_grad for s in samples for t in s.grad_inputs()))
    flag = DeviceFlag(device, options.fp8_enabled, fp8_weight_caching, NAME, "graphed callable")
    graphs = CapturedGraphs(layout, [s.name for s in samples], options, device, flag,
                            AutocastState(device))  # fmt: skip
    chunks = [fp8_modules_in([m for j in layout.units[(c, 0)].runners for m in _trees(samples[j])])
              for c in range(layout.num_chunks)]  # fmt: skip
    # The snapshot: main gradients that fused weight-gradient GEMMs add into (fp8/main_grad.py).
    params = [p for s in samples for p in s.params]
    session = CaptureSession(device, options, weight_cache_flag=flag.tensor,
                             snapshot=MainGradSnapshot(params))  # fmt: skip
    layers = FSDPLayers(fsdp) if fsdp else None
    with (
        session,
        undone_on_failure(unique(m for c in chunks for m in c), samples, callables),
        layers.capturing() if layers else contextlib.nullcontext(),
    ):
        session.init_fp8(chunks, _recipe_of(samples, options))
        warmup(samples, num_warmup_iters, allow_unused_input, session)
        if layers:
            layers.after_warmup()
        session.freeze_arenas({k: a for s in samples for k, a in s.arenas.items()})
        built = _capture_units(samples, layout, session, allow_unused_input, chain)
        if layers:
            layers.after_capture()
        chained = _followers(layout) if chain else set()
        runners = [_runner(s, built, graphs, chained, session.added) for s in samples]
    wrapped = [
        _wrap(f, r, replace_forward=not layout.explicit, fsdp=s.fsdp)
        for f, r, s in zip(funcs, runners, samples, strict=True)
    ]
    graphs.register(runners, funcs, [undo for _, undo in wrapped], _skippable(samples, layout))
    return wrapped[0][0] if just_one else tuple(g for g, _ in wrapped)


def _normalize(callables, sample_args, sample_kwargs, order):
    """(just one callable given, callables, sample_args, sample_kwargs) as tuples."""
    just_one = not isinstance(callables, tuple)
    if just_one:
        if order is not None:
            raise ValueError(f"{NAME}: order needs a tuple of callables")
        callables, sample_args, sample_kwargs = (callables,), (sample_args,), (sample_kwargs,)
    elif sample_kwargs is None:
        sample_kwargs = (None,) * len(sample_args)
    if len(sample_args) != len(sample_kwargs) or (
        order is None and len(callables) != len(sample_args)
    ):
        raise ValueError(f"{NAME}: need one sample_args entry per callable")
    return just_one, callables, sample_args, sample_kwargs


def _trees(s: Sample) -> list[nn.Module]:
    """The module trees of a callable: its own, or those a plain function closes over."""
    return s.modules[:1] + s.closure


def _recipe_of(samples: list[Sample], options: CaptureOptions):
    """module -> the recipe of the first callable whose tree holds it (None: no FP8)."""
    recipes: dict[int, object] = {}
    for s in samples:
        for tree in _trees(s):
            for m in tree.modules():
                recipes.setdefault(id(m), options.recipes[s.callable_index])
    return lambda m: recipes.get(id(m))


def _followers(layout: Layout) -> set[int]:
    """Runners that are not the first of their unit (chain=True reads their predecessor)."""
    return {j for unit in layout.units.values() for j in unit.runners[1:]}


def _skippable(samples: list[Sample], layout: Layout) -> set[int]:
    """Callables a microbatch may leave out (graphs/schedule.py): without `order`, those after the
    first whose FP8 arenas are all the first one's (whose graphs hold the scale updates)."""
    if layout.explicit:
        return set()
    first = samples[0].arenas.keys()
    return {s.index for s in samples[1:] if s.arenas.keys() <= first}


def _capture_units(samples, layout: Layout, session: CaptureSession, allow_unused: bool,
                   chain: bool) -> dict:  # fmt: skip
    """The forwards and backwards of each unit, in the layout's order: {runner: (Forward,
    Backward)}."""
    forwards, built = {}, {}
    with session.capture_phase():
        for kind, unit in layout.steps:
            unit_samples = [samples[j] for j in unit.runners]
            used = {k: a for s in unit_samples for k, a in s.arenas.items()}
            points = session.update_points(used.values())
            if kind == "forward":
                fwds = capture_forwards(unit_samples, points, session, chain)
                forwards.update(zip(unit.runners, fwds, strict=True))
            else:
                fwds = [forwards[j] for j in unit.runners]
                bwds = capture_backwards(unit_samples, fwds, points, session, allow_unused, chain)
                built.update({j: (forwards[j], b) for j, b in zip(unit.runners, bwds, strict=True)})
    return built


def _guard(s: Sample, added: dict) -> ReplayGuard:
    """What a callable's graphs assume about its modules (and the main gradients `added` into:
    CaptureSession.added). A plain function's modules are those it closes over whose parameters
    it was found to use; they must have no hooks either."""
    if s.closure:
        modules = owner_modules(s.closure, s.params)
        check_no_hooks(s.name, modules, [], [])
        roots = [(type(c).__name__, c) for c in s.closure]
    else:
        modules = s.modules
        roots = [("", s.func)] if isinstance(s.func, nn.Module) else []
    owned = {id(p) for m in modules for p in m._parameters.values()}
    outside = [(n, p) for n, p in zip(s.param_names, s.params, strict=True) if id(p) not in owned]
    if s.fsdp is not None:  # FSDP2's unsharded parameters: their storage comes and goes with the
        outside = []  # gathers; the graphs read the shards, which the modules' slots watch
    return ReplayGuard(s.name, modules, module_names(roots), outside, _RECAPTURE, added=added)


def _runner(s: Sample, built: dict, graphs: CapturedGraphs, chained: set,
            added: dict) -> GraphedRunner:  # fmt: skip
    """The frozen runner of a captured sample: its call contract and graph pair. built: {runner:
    (Forward, Backward)}; chained: the runners that read their predecessor's output; added:
    the weights whose main_grad the capture added into (CaptureSession.added)."""
    fwd, bwd = built[s.index]
    anchor = torch.empty(0, requires_grad=any(p.requires_grad for p in s.params))
    # Its AccumulateGrad node: a backward that will not run it asks for a subset of gradients.
    node = anchor.view_as(anchor).grad_fn.next_functions[0][0] if anchor.requires_grad else None
    spec = InputSpec.of(s.static_inputs, s.kwarg_names, s.alias_of)
    read_back = _read_back(s, fwd, spec)
    expects = any(g is not None for g in bwd.grad_outputs) and (
        anchor.requires_grad or any(t.requires_grad for t in s.static_inputs)
    )
    contract = CallContract(
        name=s.name, index=s.index, guard=_guard(s, added),
        uses_fp8=bool(s.arenas) or any(isinstance(m, FP8Module) for m in s.modules), spec=spec,
        chained=s.index in chained, expects_grad=expects, recipe=graphs.recipes[s.callable_index],
    )  # fmt: skip
    pair = GraphPair(
        fwd_graph=fwd.graph, bwd_graph=bwd.graph, static_inputs=s.static_inputs, copies=spec.copies,
        storages=storages_of(s.static_inputs), static_outputs=fwd.outputs, out_spec=fwd.out_spec,
        read_back=[t for _, t in read_back], read_back_names=tuple(n for n, _ in read_back),
        static_grad_outputs=bwd.grad_outputs, static_grad_inputs=bwd.grad_inputs,
        accumulator=bwd.accumulator, grad_anchor=anchor, anchor_node=node,
    )  # fmt: skip
    return GraphedRunner(contract, pair, graphs)


def _read_back(s: Sample, fwd, spec: InputSpec) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the static outputs and inputs whose storage the captured forward saved
    for its backward (graphs/contexts.saved_storages)."""
    named = [(f"output {j}", o) for j, o in enumerate(fwd.outputs)]
    named += [(f"argument {i}", s.static_inputs[i]) for i in spec.copies]
    return [(n, t) for n, t in named if t.numel() and t.untyped_storage().data_ptr() in fwd.saved]


def _wrap(func, runner: GraphedRunner, replace_forward: bool = True, fsdp=None):
    """(the graphed callable, undo or None). A module gets its forward replaced (undo puts it
    back at reset()) unless replace_forward is False (pipeline schedules: several graphs per
    module, each returned as a function). fsdp: an FSDP2 layer's FSDPLayer, whose settings are
    checked before every call and whose hooks reset() puts back (graphs/fsdp_layers.py)."""

    @opaque_to_dynamo
    def graphed(*args, is_first_microbatch=None, **kwargs):
        if fsdp is not None:  # its settings, and a prefetched gather issued (fsdp_prefetch.py)
            fsdp.settings.check()
            fsdp.prefetch.check("forward")
        flat = runner.check_call(args, kwargs, is_first_microbatch)
        expects_backward = runner.contract.expects_grad and torch.is_grad_enabled()
        if fsdp is not None:
            fsdp.prefetch.take("forward")
        outs = GraphedFunction.apply(runner, expects_backward, pair.grad_anchor, *flat)
        if fsdp is not None:
            fsdp.prefetch.done("forward")
        return pair.outputs(outs)

    def captured_ops() -> dict[str, list[str]]:
        """The dispatcher ops each graph recorded: {'forward': [...], 'backward': [...]}, and
        'sync': [...] for an FSDP2 layer captured with fsdp_sync="last"."""
        ops = {"forward": pair.fwd_graph.op_names, "backward": pair.bwd_graph.op_names}
        sync = getattr(pair.accumulator, "sync_graph", None)
        return ops if sync is None else dict(ops, sync=sync.op_names)

    def captured_kernels() -> dict[str, list[str]]:
        """What each graph replays: CUDA kernel nodes on the GPU, tape ops on the CPU."""
        return {"forward": pair.fwd_graph.kernels(), "backward": pair.bwd_graph.kernels()}

    pair = runner.pair
    extras = dict(captured_ops=captured_ops, captured_kernels=captured_kernels,
                  reset=runner.capture.reset)  # fmt: skip
    if not isinstance(func, nn.Module):
        vars(graphed).update(extras, runner=runner)
        return graphed, None
    training = func.training
    eager_forward = func.forward if fsdp is None else fsdp.eager(func.forward)

    def forward(*args, **kwargs):  # is_first_microbatch among kwargs, when given
        if func.training != training:  # torch's rule: other modes run the eager forward
            return eager_forward(*args, **kwargs)
        return graphed(*args, **kwargs)

    if not replace_forward:
        vars(forward).update(extras, runner=runner)
        return forward, None
    added = dict(extras, forward=forward, graphed_runner=runner,
                 __deepcopy__=refuse_deepcopy(func))  # fmt: skip
    vars(func).update(added)

    def undo() -> None:
        for key in added:
            vars(func).pop(key, None)
        if fsdp is not None:
            fsdp.put_hooks()

    return func, undo
