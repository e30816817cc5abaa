"""torch FSDP2 layers (fully_shard-ed submodules of an FSDP2 model) inside make_graphed_callables:
each layer's forward graph all-gathers its weights, runs the layer and reshards; its backward
graph all-gathers again after a reshard, runs the backward and reduce-scatters the gradients into
the sharded parameters' `.grad` (docs/sharding.md, "FSDP2 layers in make_graphed_callables").
With fsdp_sync="last" the backward graph accumulates the unsharded gradients instead and a sync
graph per layer reduce-scatters their sums (graphs/fsdp_layer_sync.py).

FSDP2's forward hooks are taken off a graphed layer (put back by reset()): the graphs hold what
they would run for it, called explicitly at capture (FSDPParamGroup.unshard / reshard /
post_backward), so that no FSDP2 Python runs for the layer between replays. The model's root
stays eager: its hooks gather its own parameters and its final backward callback runs as eagerly.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from graphfp8.graphs.fsdp import (
    FSDP_SYNCS,
    SYNC_SETTINGS,
    FSDPGrads,
    FSDPSettings,
    check_fsdp2_model,
)
from graphfp8.graphs.fsdp_compat import (
    cast_forward_inputs,
    cast_output,
    param_groups,
    wait_reduce_scatters,
)
from graphfp8.graphs.fsdp_layer_sync import SyncLast
from graphfp8.graphs.fsdp_prefetch import Prefetch, link_prefetch

__all__ = ["FSDPLayer", "FSDPLayers", "fsdp_layers_of", "init_fsdp2"]

_NAME = "make_graphed_callables"
_WHOLE = (
    "capture the whole forward and backward with make_graphed_microbatch(model, loss_fn, "
    "batch, ...) or the whole step with make_graphed_step(model, loss_fn, optimizer, batch, ...), "
    "or shard the graphed way: MasterWeights(model, shard_group=...)"
)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")  # fmt: skip


def init_fsdp2(model: nn.Module) -> None:
    """Runs FSDP2's lazy initialization of a fully_shard-ed model (what its root's first forward
    runs: which module is the root, the shared streams, each group's unsharded parameters), so
    that its layers can be given to make_graphed_callables before any forward. No collective, no
    FP8 state, nothing gathered; a no-op after the first forward."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise TypeError(f"init_fsdp2: {type(model).__name__} is not under fully_shard; pass the "
                        "model's root, fully_shard(model) after its layers")  # fmt: skip
    model._get_fsdp_state()._lazy_init()


def fsdp_layers_of(funcs, order, fsdp_sync: str = "every") -> list[FSDPLayer] | None:
    """One FSDPLayer per callable when the callables are FSDP2 layers (None when no module
    callable holds an FSDP2 module): each a fully_shard-ed layer, or a module without parameters
    of its own around one (an adapter that calls the layer with fixed arguments). Raises, naming
    what captures it, for what per-layer graphs do not take: a mix, a module around several
    FSDP2 modules, a pipeline `order`; fsdp_sync "last" (graphs/fsdp_layer_sync.py) for callables
    that are no FSDP2 layers."""
    if fsdp_sync not in FSDP_SYNCS:
        raise ValueError(f"{_NAME}: fsdp_sync must be one of {FSDP_SYNCS}, got {fsdp_sync!r}")
    inside = [_fsdp_modules(f) for f in funcs]
    if not any(inside):
        if fsdp_sync != "every":
            raise ValueError(f"{_NAME}: fsdp_sync='last' is for fully_shard-ed layers (torch "
                             "FSDP2); leave it 'every' for these callables")  # fmt: skip
        return None
    plain = [j for j, found in enumerate(inside) if not found]
    if plain:
        raise RuntimeError(
            f"{_NAME}: callables {plain} hold no module under fully_shard while others do; "
            "FSDP2 layers are captured one graph pair per fully_shard-ed layer: fully_shard "
            f"each graphed module, or {_WHOLE}"
        )
    if order is not None:
        raise RuntimeError(f"{_NAME}: FSDP2 layers under a pipeline order= are not supported; "
                           f"{_WHOLE}")  # fmt: skip
    layers = []
    for j, (f, found) in enumerate(zip(funcs, inside, strict=True)):
        name = f"graphed callable {j} ({type(f).__name__})"
        inner = found[0]
        if inner is not f:
            own = {id(p) for p in inner.parameters()}
            outside = [n for n, p in f.named_parameters() if id(p) not in own]
            if len(found) > 1 or outside:
                raise RuntimeError(
                    f"{_NAME}: {name} is not under fully_shard but holds fully_shard-ed "
                    f"modules {[type(m).__name__ for m in found]} (and parameters {outside} "
                    "outside them); a graphed FSDP2 layer is one fully_shard-ed module, or a "
                    f"module around one with no parameters of its own. Capture each, or {_WHOLE}"
                )
        layers.append(FSDPLayer(name, inner, fsdp_sync == "last"))
    link_prefetch(_NAME, layers, _WHOLE)  # FSDP2's explicit prefetch (graphs/fsdp_prefetch.py)
    return layers


def _fsdp_modules(func) -> list[nn.Module]:
    """The FSDP2 modules of a module callable, outermost first ([] for a plain function)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(func, nn.Module):
        return []
    return [m for m in func.modules() if isinstance(m, FSDPModule)]


class FSDPLayer:
    """One fully_shard-ed layer's FSDP2 work, run explicitly inside its graphs.

    Args:
        name: the graphed callable's name, for messages.
        module: the FSDPModule (the callable, or the one it wraps; not FSDP2's root: the
            root's hooks run eagerly around it).
        sync_last: fsdp_sync="last": the backward graph accumulates the unsharded gradients, a
            sync graph reduces them (graphs/fsdp_layer_sync.py).
    """

    def __init__(self, name: str, module: nn.Module, sync_last: bool = False):
        self.name, self.module = name, module
        self.state = module._get_fsdp_state()
        check_fsdp2_model(_NAME, module)
        self._check_state()
        self.group = self.state._fsdp_param_group
        self.reshard_after_forward = self.group._reshard_after_forward
        self.grads = FSDPGrads(p for p in module.parameters() if p.requires_grad)
        self.settings: FSDPSettings | None = None  # taken after capture
        self.hooks: list | None = None
        self.sync = SyncLast(name) if sync_last else None
        self.prefetch = Prefetch(name)

    def _check_state(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPMeshInfo

        st, name = self.state, self.name
        holds = any(m is not self.module and isinstance(m, FSDPModule)
                    for m in self.module.modules())  # fmt: skip
        if st._is_root is None and not holds:
            raise RuntimeError(
                f"{_NAME}: {name} is under fully_shard, but FSDP2 has not initialized it (it "
                "does at the root's first forward): call graphfp8.init_fsdp2(model) on the "
                "model's root before capturing its layers (a model under fully_shard at its "
                f"root only is captured whole: {_WHOLE})"
            )
        if st._is_root or holds:
            raise RuntimeError(
                f"{_NAME}: {name} is FSDP2's root or holds fully_shard-ed submodules; per-layer "
                "graphs capture fully_shard-ed layers (no FSDP2 module inside) of a model whose "
                "root (fully_shard(model), run eagerly) holds the rest: capture "
                f"model.layers[i], or {_WHOLE}"
            )
        groups = param_groups(st)
        if len(groups) != 1:
            raise RuntimeError(
                f"{_NAME}: {name} has {len(groups)} FSDP2 parameter groups; a "
                f"graphed FSDP2 layer is one fully_shard group with parameters, or {_WHOLE}"
            )
        g = groups[0]
        if not isinstance(g.mesh_info, FSDPMeshInfo) or g._is_hsdp or g._use_post_forward_mesh:
            raise RuntimeError(
                f"{_NAME}: {name} is sharded on HSDP's 2-D mesh or reshards after forward to "
                "another mesh (reshard_after_forward=int), which per-layer graphs do not "
                f"capture; {_WHOLE}"
            )
        if not (g.reduce_grads and g.reshard_after_backward and g.unshard_in_backward):
            raise RuntimeError(
                f"{_NAME}: {name}: FSDP2's set_requires_gradient_sync(False), "
                "set_reshard_after_backward(False) or unshard_in_backward=False is set; "
                "per-layer graphs capture FSDP2's defaults there (make_graphed_callables(..., "
                "fsdp_sync='last') for gradient accumulation without communication). Unset "
                f"it, or {_WHOLE}"
            )
        if not g.is_sharded:
            raise RuntimeError(
                f"{_NAME}: FSDP2 holds {name}'s parameters gathered (an eager forward with "
                "reshard_after_forward=False, or unshard()); call .reshard() on it first"
            )

    # The hooks --------------------------------------------------------------------------------

    def take_hooks(self) -> None:
        """Takes FSDP2's forward hooks off the module (the graphs hold their work)."""
        keys = {self.state._pre_forward_hook_handle.id, self.state._post_forward_hook_handle.id}
        self.hooks = []
        for attr in _HOOK_DICTS:
            table = getattr(self.module, attr)
            for key in [k for k in table if k in keys]:
                self.hooks.append((attr, key, table.pop(key)))

    def put_hooks(self) -> None:
        """Puts FSDP2's forward hooks back, its pre-forward hook first (fully_shard prepends it)."""
        pre = self.state._pre_forward_hook_handle.id
        for attr, key, value in self.hooks or ():
            table = getattr(self.module, attr)
            table[key] = value
            if key == pre and hasattr(table, "move_to_end"):
                table.move_to_end(key, last=False)
        self.hooks = None

    # What the graphs hold -----------------------------------------------------------------------

    def run(self, func, args, kwargs):
        """The layer's forward as FSDP2's hooks run it: inputs cast (MixedPrecisionPolicy),
        weights all-gathered, the forward, the reshard (reshard_after_forward), output cast."""
        args, kwargs = cast_forward_inputs(self.state, tuple(args), kwargs)
        self._unshard()
        self.prefetch.issue("forward")  # FSDP2's explicit forward prefetch, before the compute
        out = func(*args, **kwargs)
        if self.reshard_after_forward:
            self.group.reshard()
        self.prefetch.join()
        return cast_output(self.state, out)

    def backward(self, outs, inputs, grad_outputs, params, allow_unused: bool) -> tuple:
        """The layer's backward as FSDP2 runs it: the all-gather again after a reshard, the
        gradients (the parameters' put in their unsharded `.grad`, as AccumulateGrad does), the
        reduce-scatter into the sharded `.grad` and the reshard (reduce). fsdp_sync "last", once
        warmed up: the parameters' gradients added into the unsharded sums instead, no reduce
        (the sync graph's). Returns the gradients with the parameters' as None."""
        self._unshard()
        self.prefetch.issue("backward")  # FSDP2's explicit backward prefetch
        grads = torch.autograd.grad(outs, inputs, grad_outputs, allow_unused=allow_unused)
        n = len(params)
        own = grads[len(grads) - n :]
        if self.sync is not None and self.sync.ready:
            self.sync.accumulate(params, own)
        else:
            if self.sync is not None:
                self.sync.seen(params, own)
            for p, g in zip(params, own, strict=True):
                p.grad = g
            self.reduce()
        self.prefetch.join()
        return tuple(grads[: len(grads) - n]) + (None,) * n

    def reduce(self) -> None:
        """FSDP2's post_backward of the unsharded `.grad` (the reduce-scatter into the sharded
        `.grad`, the reshard), finalize, and the wait for the reduce-scatter that the root's
        final callback does eagerly."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        group = self.group
        group.post_backward()
        group.finalize_backward()
        wait_reduce_scatters(group.comm_ctx, group.device_handle.current_stream())
        group._training_state = TrainingState.IDLE

    def _unshard(self) -> None:
        """The all-gather and copy-out into the unsharded parameters, freed at once (no implicit
        prefetch state left for a later call: graphs/fsdp_layers.py's docstring)."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        group = self.group
        if group.is_unsharded:
            return
        if group.device.type == "cuda":  # the all-gather streams fork from the capture stream
            current, comm = torch.cuda.current_stream(), group.comm_ctx
            comm.all_gather_copy_in_stream.wait_stream(current)
            comm.all_gather_stream.wait_stream(current)
        with group.use_training_state(TrainingState.PRE_BACKWARD):
            group.unshard()
            group.wait_for_unshard()

    def idle(self) -> None:
        """After a failed capture: the layer sharded and idle, as FSDP2's next forward expects."""
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        self.group._training_state = TrainingState.IDLE
        self.group._all_gather_result = None
        self.group.reshard()

    def names(self, params) -> list[str]:
        """The names of the unsharded parameters the capture found (FSDP2's parameter names)."""
        fqn = {id(fp.unsharded_param): fp._param_fqn for fp in self.group.fsdp_params
               if hasattr(fp, "_unsharded_param")}  # fmt: skip
        return [fqn.get(id(p), f"{self.name} unsharded parameter") for p in params]

    def eager(self, forward):
        """The layer's eager forward with FSDP2's hooks run around it (a call in another
        training mode than the capture's: torch's rule runs the eager forward); under
        torch.no_grad() the layer is resharded after it, as the next replay expects."""

        def call(*args, **kwargs):
            args, kwargs = self.state._pre_forward(self.module, args, kwargs)
            out = self.state._post_forward(self.module, args, forward(*args, **kwargs))
            if not torch.is_grad_enabled():  # no backward reshards: the graphs gather anyway
                self.group.reshard()
            return out

        return call


class FSDPLayers:
    """The FSDP2 layers of one make_graphed_callables capture: their hooks taken off and their
    sharded `.grad` set aside while warming up and capturing, each used sharded parameter given
    a persistent `.grad` buffer that the captured reduce-scatter adds into (graphs/fsdp.py's
    FSDPGrads, with its replay bookkeeping)."""

    def __init__(self, layers: list[FSDPLayer]):
        self.layers = layers

    @contextlib.contextmanager
    def capturing(self):
        """Around warmup and capture: hooks off (back on failure), the user's `.grad` back."""
        for layer in self.layers:
            layer.take_hooks()
            layer.grads.save()
        try:
            yield
        except BaseException:
            for layer in self.layers:
                layer.put_hooks()
                layer.grads.restore()
                layer.idle()
            raise

    def after_warmup(self) -> None:
        """Persistent sharded `.grad` buffers of the parameters that got one in warmup."""
        for layer in self.layers:
            layer.grads.take_warmup(layer.name)
            layer.grads.attach()
            if layer.sync is not None:
                layer.sync.build(layer.group)
            layer.prefetch.after_warmup(layer.group)

    def after_capture(self) -> None:
        """Checks that FSDP2 added into the buffers, puts the user's `.grad` back and takes the
        settings every call compares (FSDPSettings)."""
        for layer in self.layers:
            layer.grads.check_captured(layer.name)
            layer.grads.restore()
            sets = SYNC_SETTINGS if layer.sync is not None else ()  # its eager loop sets them
            layer.settings = FSDPSettings(layer.name, layer.module, graph_sets=sets)
            layer.prefetch.settings = layer.settings  # checked before the backward too
