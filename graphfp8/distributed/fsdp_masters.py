"""fp32 masters of FP8 primary weights under torch FSDP2: `g8.MasterWeights(model)` on a model whose
graphfp8 layers were built inside fp8_model_init and then sharded by `fully_shard`.

    model = ...  # graphfp8 layers built inside fp8_model_init
    fully_shard(model, mesh=mesh)          # FP8 shards: DTensors of Float8Tensor (tensor_fsdp.py)
    masters = g8.MasterWeights(model)      # an FSDPMasterWeights (distributed/masters.py)
    opt = torch.optim.AdamW(masters.parameters())   # DTensor masters + the other DTensors
    ... forward / backward under fp8_autocast (FSDP2 all-gathers the weights in FP8) ...
    masters.clip_grad_norm_(1.0)           # optional: the global norm (DTensors)
    masters.step(opt)
    masters.zero_grad()

Each FP8 weight's master is a DTensor of its fp32 local shard, placed like the weight, so the
optimizer and clip_grad_norm_ see DTensors as for every other FSDP2 parameter. As the unsharded
masters' (fp8/master.py), a master's `.grad` is its weight's gradient shard in fp32: reading it
first moves the weight's pending reduced shard (FSDP2's reduce-scatter made it) into it (added to
what it holds; the weight's `.grad` becomes None), so whatever reads the masters' grads after the
backward sees every gradient: `masters.clip_grad_norm_(c)`,
`torch.nn.utils.clip_grad_norm_(masters.parameters(), c)` (the global norm, through DTensor) and
the same of `model.parameters()` (the shards clipped in place, then moved) clip alike, bit for
bit (parameters() keeps the model's order). `step` moves the pending shards in, steps, and writes
the shards back with one amax per weight over the shard group (group_quantize.py): every shard
of a weight gets the same scale_inv, which the FP8 all-gather ships with the bytes, and the
weights are quantized exactly as on one process. The scales of all FP8 weights come from one
MAX all-reduce of their (W,) amax vector per step, whatever the number of layers: what torchao's
precompute_float8_dynamic_scale_for_fsdp does after the optimizer step, done by `step` itself
(docs/sharding.md, "FP8 weight scales"). HSDP meshes (replicate, shard) train the same way, the
amaxes reduced over the shard group (shard_group below).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from graphfp8.distributed.group_quantize import GroupQuantizer
from graphfp8.fp8.master import (
    TENSOR_GRAD,
    ClaimAnchor,
    MasterWeights,
    check_fp8_weights_kept,
    claim,
)
from graphfp8.fp8.tensor import is_fsdp_fp8

__all__ = ["FSDPMasterWeights", "fsdp_fp8_weights", "shard_group"]


def fsdp_fp8_weights(model: nn.Module) -> list[tuple[str, DTensor]]:
    """The (name, parameter) pairs of `model` that FSDP2 shards hold as FP8 (DTensors of
    Float8Tensor shards)."""
    return [(n, p) for n, p in model.named_parameters() if is_fsdp_fp8(p)]


class _FSDPMaster(DTensor):
    """An fp32 master shard (a DTensor placed like its FP8 weight) whose `.grad` first takes in
    the weight's pending reduced gradient shard (module docstring). Ops on it return DTensors."""

    _weight: DTensor

    @property
    def grad(self):
        w = self._weight
        if w.grad is not None:
            with torch.no_grad():
                pending, held = w.grad._local_tensor, TENSOR_GRAD.__get__(self)
                if held is None:
                    TENSOR_GRAD.__set__(self, _like(w, pending.to(torch.float32, copy=True)))
                else:
                    held._local_tensor.add_(pending)
                w.grad = None
        return TENSOR_GRAD.__get__(self)

    @grad.setter
    def grad(self, value) -> None:
        self._weight.grad = None  # the pending gradient belongs to the old value
        TENSOR_GRAD.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None


def _master(p: DTensor) -> _FSDPMaster:
    """The fp32 master of FSDP2 FP8 shard p: its dequantized local shard, placed like p."""
    local = p._local_tensor.dequantize(torch.float32)
    m = DTensor.__new__(_FSDPMaster, local, _like(p, local)._spec, requires_grad=p.requires_grad)
    m._weight = p
    return m


class FSDPMasterWeights(MasterWeights):
    """Masters of the FP8 shards of an FSDP2 model; other parameters are stepped as they are.

    Args:
        model: a model under fully_shard whose FP8 primary weights are sharded on one 1-D mesh
            or one HSDP (replicate, shard) mesh.
    """

    def __init__(self, model: nn.Module) -> None:
        check_fp8_weights_kept(model, "MasterWeights")
        named = fsdp_fp8_weights(model)
        self.names = [n for n, _ in named]
        self.fp8_params = [p for _, p in named]
        fp8_ids = {id(p) for p in self.fp8_params}
        self.others = [p for p in model.parameters() if id(p) not in fp8_ids]
        self.group = shard_group(self.fp8_params)
        self._anchor = ClaimAnchor()
        claim(self.names, self.fp8_params, self._anchor)
        self._checked_optimizer = None
        self.masters = [_master(p) for p in self.fp8_params]
        by_weight = {id(p): m for p, m in zip(self.fp8_params, self.masters, strict=True)}
        self._in_model_order = [by_weight.get(id(p), p) for p in model.parameters()]
        locals_ = [p._local_tensor for p in self.fp8_params]
        self.quantizer = GroupQuantizer([t.fp8_dtype for t in locals_], locals_[0].device)
        self.write_back_()

    def tensors(self) -> list[torch.Tensor]:
        return [*(m._local_tensor for m in self.masters), self.quantizer.scale]

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer updates, in the model's order with each FP8 weight's master in its
        place: a norm over them sums in the order one over model.parameters() does (the same bits
        where the weights' gradients are fp32; bf16 gradient shards are normed and scaled in
        bf16 by torch's clip, their fp32 masters' in fp32: docs/sharding.md)."""
        return list(self._in_model_order)

    @torch.no_grad()
    def copy_grads_(self) -> None:
        """Each FP8 weight's pending reduced gradient shard moved into its master's fp32 grad,
        as reading the master's .grad does."""
        for m in self.masters:
            m.grad  # noqa: B018 - the property moves the pending gradient in

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clips every gradient (the masters' and the other parameters') by the global L2 norm
        over the mesh, torch.nn.utils.clip_grad_norm_ of masters.parameters(). Returns the norm
        (0-d float32, the same on every rank)."""
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    @torch.no_grad()
    def write_back_(self) -> None:
        """Every shard from its master, one amax per weight over the shard group (one MAX
        all-reduce for all weights); the same scale_inv into every shard (read from the
        parameter each time: FSDP2 may replace the shard tensor, padded, at its first
        forward)."""
        locals_ = [p._local_tensor for p in self.fp8_params]
        pieces = [(i, m._local_tensor.reshape(-1), t._data.reshape(-1))
                  for i, (m, t) in enumerate(zip(self.masters, locals_, strict=True))
                  if t.numel() > 0]  # fmt: skip
        self.quantizer.quantize_(pieces, self.group)
        scale_inv = self.quantizer.scale_inv
        torch._foreach_copy_([t._scale_inv for t in locals_],
                             [scale_inv[i : i + 1] for i in range(len(locals_))])  # fmt: skip
        for t in locals_:
            t.mark_data_changed(transpose_written=False)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """copy_grads_, optimizer.step(), write_back_."""
        self._check_optimizer(optimizer)
        self.copy_grads_()
        optimizer.step()
        self.write_back_()

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restores this rank's master shards (saved by state_dict() on the same mesh)."""
        saved = state["masters"]
        if sorted(saved) != sorted(self.names):
            raise ValueError(f"MasterWeights.load_state_dict: masters for {sorted(saved)}, the "
                             f"model's FP8 weights are {sorted(self.names)}")  # fmt: skip
        for n, m in zip(self.names, self.masters, strict=True):
            t = saved[n]
            if not isinstance(t, DTensor) or t.shape != m.shape or t.placements != m.placements:
                raise ValueError(f"MasterWeights.load_state_dict: the master of {n} is not a "
                                 f"{tuple(m.shape)} DTensor placed {m.placements}")  # fmt: skip
        for n, m in zip(self.names, self.masters, strict=True):
            m._local_tensor.copy_(saved[n]._local_tensor)
        self.write_back_()


def shard_group(weights: list[DTensor]):
    """The process group over which FSDP2 shards `weights` (their mesh's last dimension): the
    group of their amax all-reduce. 1-D meshes, and HSDP's 2-D (replicate, shard) meshes: there
    the replicas hold the same shards bit for bit (FSDP2 all-reduces the gradients across them),
    so the amax over the shard group is the whole weight's on every rank (docs/sharding.md,
    "HSDP"). Raises ValueError for anything else, before any state changes."""
    meshes = {p.device_mesh for p in weights}  # equal meshes: DTensor may copy one
    placements = {tuple(p.placements) for p in weights}
    hsdp = (Replicate(), Shard(0))
    if len(meshes) != 1 or len(placements) != 1 or placements.pop() not in ((Shard(0),), hsdp):
        found = sorted({f"{p.device_mesh.ndim}-D mesh {tuple(p.placements)}" for p in weights})
        raise ValueError(
            "MasterWeights of an FSDP2 model: its FP8 weights must be sharded on one device "
            "mesh, 1-D (fully_shard(model, mesh=init_device_mesh(..., (N,)))) or HSDP's 2-D "
            "(replicate, shard) mesh (init_device_mesh(..., (R, N // R))); found "
            + ", ".join(found)
        )
    mesh = weights[0].device_mesh
    return mesh.get_group(mesh.ndim - 1)


def _like(p: DTensor, local: torch.Tensor) -> DTensor:
    """`local` as a DTensor placed like parameter p (an uneven shard keeps p's global shape)."""
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())  # fmt: skip
