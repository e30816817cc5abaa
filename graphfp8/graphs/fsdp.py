"""torch FSDP2 (fully_shard) models inside make_graphed_microbatch and make_graphed_step (its FSDP2
step: graphs/step_fsdp.py): what is captured, the checks before capture, the sharded gradients'
persistent buffers, the FSDP2 settings a replay assumes and the gradient sync a step graph with
fsdp_sync="last" sets on each microbatch (docs/sharding.md, "FSDP2 inside the graphs").

The microbatch graph holds FSDP2's whole forward and backward as its hooks ran them at capture:
the all-gathers (FP8 weights as FP8 bytes through Float8Tensor's hooks, fp8/tensor_fsdp.py), the
reshard after forward and the backward's all-gather again when reshard_after_forward=True, the
reduce-scatters and their division, and the accumulation into each sharded parameter's `.grad`.
FSDP2's Python (hooks, its state machine, its stream waits) runs once, at capture; a replay runs
the kernels and collectives it launched, in that order (the CPU tape records the storage resizes
of the gathered parameters too: graphs/tape.py).
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from graphfp8.fp8.tensor_fsdp import fsdp_module_types
from graphfp8.graphs.backends import new_graph
from graphfp8.graphs.fsdp_prefetch import PrefetchSettings
from graphfp8.graphs.grads import GradAccumulator, fill_minus_zero

__all__ = ["FSDP_SYNCS", "FSDPGrads", "FSDPSettings", "FSDPSnapshot", "check_fsdp2_model",
           "check_fsdp_sync", "fsdp_hook", "is_fsdp2", "refusal", "set_fsdp_sync"]  # fmt: skip

_MICROBATCH = "make_graphed_microbatch"


def is_fsdp2(model) -> bool:
    """Whether `model` (an nn.Module) is under torch FSDP2: any of its modules is an FSDPModule."""
    if not isinstance(model, nn.Module) or not fsdp_module_types():
        return False
    fsdp2 = fsdp_module_types()[0]
    return any(isinstance(m, fsdp2) for m in model.modules())


def fsdp_hook(hook) -> bool:
    """Whether a module hook is one of FSDP2's own (its pre- and post-forward hooks)."""
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__module__", "").startswith("torch.distributed.fsdp.")


def refusal(entry: str) -> str:
    """Why `entry` (make_graphed_callables) does not capture a plain function over FSDP2 modules,
    and what does."""
    why = (
        "FSDP2's per-module hooks all-gather the weights before a module's forward and "
        "reduce-scatter after its backward, around the calls that a graphed function "
        "replays, so its graph would read parameters that are not gathered"
    )
    return (
        f"{entry}: cannot capture a function over modules under torch FSDP2 (fully_shard): "
        f"{why}. Give it the fully_shard-ed layers themselves (one graph pair each, FSDP2's "
        "collectives inside: graphs/fsdp_layers.py), or capture the "
        f"whole forward and backward with {_MICROBATCH}(model, loss_fn, batch, fp8_enabled=..., "
        "fp8_group=...) (FSDP2's all-gathers and reduce-scatters inside the graph) or the whole "
        "step with make_graphed_step(model, loss_fn, optimizer, batch, ...), or shard the "
        "graphed way: MasterWeights(model, shard_group=...)"
    )


def check_fsdp2_model(entry: str, model: nn.Module) -> None:
    """Raises, naming the fix, unless make_graphed_microbatch can capture FSDP2 model `model`:
    fully_shard at the root (every parameter a DTensor of FSDP2), no CPU offload (FSDP1 is
    refused by the caller, capture_checks.py). 1-D meshes and HSDP's 2-D ones are captured."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    if not isinstance(model, FSDPModule):
        raise RuntimeError(
            f"{entry}: a model whose submodules are under FSDP2 must be under fully_shard "
            "itself too (fully_shard(model) after its layers, FSDP2's usual wrapping): the "
            "graph captures FSDP2's root forward and backward, which hold every parameter"
        )
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"{entry}: parameters {plain} are not sharded by FSDP2 (not "
                           "DTensors); fully_shard the model at the root")  # fmt: skip
    for group in _param_groups(model):
        if isinstance(group.offload_policy, CPUOffloadPolicy):
            raise RuntimeError(f"{entry}: FSDP2's CPUOffloadPolicy copies between host and "
                               "device, which a graph cannot do; train it eagerly")  # fmt: skip


def _param_groups(model: nn.Module) -> list:
    """Every FSDPParamGroup of the model's FSDP2 modules (modules without parameters have none)."""
    from torch.distributed.fsdp import FSDPModule

    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    return [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]


_PLAIN = (bool, int, float, str, type(None), enum.Enum)

# fsdp_sync of make_graphed_step: "every" microbatch reduce-scatters (FSDP2's default), or only
# the "last" one (gradient accumulation without communication; docs/sharding.md).
FSDP_SYNCS = ("every", "last")
# The FSDPParamGroup settings that set_fsdp_sync writes (what a graph with fsdp_sync="last" sets
# itself on every microbatch, so the replay's settings check leaves them out).
SYNC_SETTINGS = ("reduce_grads", "all_reduce_grads", "reshard_after_backward")


def set_fsdp_sync(model: nn.Module, sync: bool) -> None:
    """FSDP2's set_requires_gradient_sync(sync) and set_reshard_after_backward(sync) on every
    FSDP module of `model` (the root need not be one): False on every microbatch but the last
    accumulates the unsharded gradients and keeps the weights gathered, with no reduce-scatter
    and no all-gather again; True on the last reduce-scatters their sum (docs/sharding.md,
    "Gradient accumulation without communication")."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(sync, recurse=False)
            m.set_reshard_after_backward(sync, recurse=False)


def check_fsdp_sync(entry: str, model: nn.Module, fsdp_sync: str, fsdp2: bool) -> None:
    """Raises, naming the fix, unless `fsdp_sync` is one of FSDP_SYNCS that `model` can take:
    "last" needs an FSDP2 model left with FSDP2's defaults for what it sets itself (gradient
    sync, all-reduce and reshard after backward all True)."""
    if fsdp_sync not in FSDP_SYNCS:
        raise ValueError(f"{entry}: fsdp_sync must be one of {FSDP_SYNCS}, got {fsdp_sync!r}")
    if fsdp_sync == "every":
        return
    if not fsdp2:
        raise ValueError(f"{entry}: fsdp_sync='last' is for a model under torch FSDP2 "
                         "(fully_shard); leave it 'every' for this model")  # fmt: skip
    off = sorted({k for g in _param_groups(model) for k in SYNC_SETTINGS if not getattr(g, k)})
    if off:
        raise ValueError(
            f"{entry}: fsdp_sync='last' sets FSDP2's gradient sync and reshard after backward "
            f"itself on every microbatch, but {off} are off in the model: put back FSDP2's "
            "defaults (model.set_requires_gradient_sync(True), "
            "model.set_reshard_after_backward(True)) before capture"
        )


def _settings(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if isinstance(v, _PLAIN)}


class FSDPSettings:
    """FSDP2's settings and states as the capture left them (reshard_after_forward, gradient
    sync, reduce-scatter division, training and sharded state of every group), compared before
    every replay: the graph holds what FSDP2 did at capture, so set_requires_gradient_sync(False),
    set_reshard_after_forward(...) or an eager forward that left a group gathered would make the
    replay differ from eager FSDP2; so would FSDP2's explicit prefetch to or from the model's
    modules (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch) set, changed or
    removed (graphs/fsdp_prefetch.py's PrefetchSettings). `graph_sets`: settings the graph sets
    itself on every microbatch (fsdp_sync="last": SYNC_SETTINGS), as its eager loop does, left
    out."""

    def __init__(self, entry: str, model: nn.Module, graph_sets: tuple[str, ...] = ()):
        self.entry, self.model, self.graph_sets = entry, model, graph_sets
        self.groups = _param_groups(model)
        self.saved = self._now()
        self.prefetch = PrefetchSettings(entry, model, self.groups)

    def _now(self) -> list:
        return [({k: v for k, v in _settings(g).items() if k not in self.graph_sets},
                 g.post_forward_mesh_info is None) for g in self.groups]  # fmt: skip

    def check(self) -> None:
        """Raises RuntimeError naming the group and setting (or prefetch) that changed since
        capture."""
        self.prefetch.check()
        now = self._now()
        if now == self.saved:
            return
        gathered = [g._module_fqn or "the root" for g in self.groups if not g.is_sharded]
        if gathered:
            raise RuntimeError(
                f"{self.entry}: FSDP2 holds the parameters of {gathered} gathered, as an eager "
                "forward with reshard_after_forward=False leaves them (FSDP2's default for the "
                "root; under torch.no_grad() no backward reshards them); the graph gathers them "
                "itself. Call .reshard() on those modules (model.reshard() for the root) after "
                "the eager forward"
            )
        for g, (a, a_none), (b, b_none) in zip(self.groups, self.saved, now, strict=True):
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            if a_none != b_none:
                keys.append("post_forward_mesh_info (reshard_after_forward)")
            if keys:
                raise RuntimeError(
                    f"{self.entry}: FSDP2's {keys} of {g._module_fqn or 'the root'!r} changed "
                    f"since capture ({[a.get(k) for k in keys if k in a]} -> "
                    f"{[b.get(k) for k in keys if k in b]}); the graph replays what FSDP2 did "
                    "at capture (its all-gathers, reshards and reduce-scatters). Put them back, "
                    "or capture again"
                )


class FSDPGrads:
    """The sharded parameters' `.grad` under a microbatch graph: one persistent DTensor buffer per
    parameter that gets a gradient, into which the captured reduce-scatter accumulates (FSDP2's
    `grad._local_tensor += shard`), with GradAccumulator's replay bookkeeping: after
    zero_grad(set_to_none=True) a captured fill with -0.0 (-0.0 + g is g bit for bit, as FSDP2's
    first microbatch assigns the reduced shard), a `.grad` of the user's copied in and out.

    Args:
        params: the model's trainable parameters (DTensors).
    """

    def __init__(self, params):
        self.params = list(params)
        self.saved: list | None = None
        self.buffers: list = []
        self.used: list = []

    def save(self) -> None:
        """Takes every `.grad` away (kept, with a copy of its values: the CPU tape runs what it
        records, FSDP2 accumulates in place) before warmup or capture."""
        self.saved = [(p.grad, None if p.grad is None else p.grad.detach().clone())
                      for p in self.params]  # fmt: skip
        for p in self.params:
            p.grad = None

    def restore(self) -> None:
        """Puts back what save() took (nothing when nothing was taken)."""
        if self.saved is None:
            return
        with torch.no_grad():
            for p, (g, values) in zip(self.params, self.saved, strict=True):
                if g is not None:
                    g.copy_(values)
                p.grad = g
        self.saved = None

    def take_warmup(self, name: str) -> None:
        """After a warmup microbatch: the parameters that got a gradient, each with a zero
        buffer placed like FSDP2's gradient shard."""
        from torch.distributed.tensor import DTensor

        self.used = [p for p in self.params if p.grad is not None]
        if not self.used:
            raise ValueError(f"{name}: no parameter gets a gradient from the loss")
        self.buffers = []
        for p in self.used:
            g = p.grad
            local = torch.zeros_like(g._local_tensor)
            self.buffers.append(DTensor.from_local(local, g.device_mesh, g.placements,
                                                   run_check=False, shape=g.shape,
                                                   stride=g.stride()))  # fmt: skip

    def attach(self) -> None:
        """Before capture: every used parameter's `.grad` is its buffer (FSDP2 adds into it)."""
        for p, b in zip(self.used, self.buffers, strict=True):
            p.grad = b

    def take_assigned(self, name: str) -> None:
        """After a step graph's capture that began with every `.grad` None: the `.grad` FSDP2
        assigned each used parameter (a view of its reduce-scatter output, in the graph's
        memory, which every replay writes again) becomes its buffer."""
        got = [p for p in self.params if p.grad is not None]
        if [id(p) for p in got] != [id(p) for p in self.used]:
            raise RuntimeError(
                f"{name}: the parameters that got a gradient at capture ({len(got)}) are not "
                f"those of warmup ({len(self.used)}): data-dependent control flow, which a "
                "graph cannot hold"
            )
        self.buffers = [p.grad for p in self.used]

    def check_captured(self, name: str) -> None:
        """After capture: FSDP2 accumulated into the buffers, it did not replace them."""
        replaced = [i for i, (p, b) in enumerate(zip(self.used, self.buffers, strict=True))
                    if p.grad is not b]  # fmt: skip
        if replaced:
            raise RuntimeError(
                f"{name}: FSDP2 replaced the gradient buffers of {len(replaced)} parameters "
                "during capture instead of accumulating into them"
            )

    def accumulator(self, device, pool) -> GradAccumulator:
        """The replay bookkeeping, with its captured fill of the local shards with -0.0
        (grads.fill_minus_zero)."""
        locals_ = [b._local_tensor for b in self.buffers]
        saved = [t.clone() for t in locals_] if device.type == "cpu" else None
        reset = new_graph(device)
        with reset.capture(pool):
            fill_minus_zero(locals_)
        if saved is not None:
            torch._foreach_copy_(locals_, saved)
        return GradAccumulator(self.used, self.buffers, reset)


class FSDPSnapshot:
    """What a warmup or a CPU capture of an FSDP2 microbatch changes, put back after it: the
    model's buffers and the sharded parameters' `.grad` (FSDPGrads.save). The parameters
    themselves are left alone: the microbatch does not step them."""

    def __init__(self, model: nn.Module, grads: FSDPGrads):
        self.buffers = list(model.buffers())
        self.saved = [b.detach().clone() for b in self.buffers]
        self.grads = grads

    def restore(self) -> None:
        with torch.no_grad():
            for b, saved in zip(self.buffers, self.saved, strict=True):
                b.copy_(saved)
        self.grads.restore()
