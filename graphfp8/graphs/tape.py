"""The CPU replay tape: records every dispatcher op run during a capture and replays exactly those
ops on the same tensors, without running Python again - a CPU stand-in for a CUDA graph that
freezes Python state the same way a CUDA graph does. In-place torch.distributed collectives (the
amax all-reduce over fp8_group, the gradient all-reduce, the sharded masters' reduce-scatter and
all-gather) are replayed too: re-issued on the same tensors at the same point, then waited for, as
a NCCL collective captured in a CUDA graph runs in stream order. While recording, a collective is
waited for inside the recorder and the caller gets a finished Work: what a Work's wait() runs
(gloo's reduce-scatter copies its result out of an internal buffer there) belongs to that Work,
and the replay's own wait() runs it again; recorded, it would copy the capture's stale buffer
over every replay's result.

The same recording mode guards CUDA captures: an op that would synchronise with the host (or
whose output shape depends on data) raises a CaptureError naming the op and the user's line,
instead of the nameless CUDA error a capture would end with.

Storage resizes (`UntypedStorage.resize_`, which torch FSDP2 uses to free a gathered parameter
after its use and to allocate it again before the next all-gather) are not dispatcher ops: the
tape records them too and replays them at the same point, so a replay writes the all-gather into
allocated memory and frees it where the capture did (on the GPU the addresses of a CUDA graph's
pool stay valid across replays without this; docs/sharding.md, "FSDP2 inside the graphs").
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from graphfp8.ops.gemm import onednn_off

__all__ = ["CaptureError", "RecordingMode", "ReplayTape"]

aten = torch.ops.aten

# Ops that read tensor data back to the host.
_HOST_SYNC = {
    aten._local_scalar_dense.default: "Tensor.item() / bool() / int() / float() of a tensor",
    aten.is_nonzero.default: "bool() of a tensor",
    aten.equal.default: "torch.equal",
}
# Ops whose output shape depends on the data.
_DATA_DEPENDENT = {
    aten.nonzero.default: "torch.nonzero / boolean indexing",
    aten.masked_select.default: "torch.masked_select",
    aten.unique_consecutive.default: "torch.unique_consecutive",
    aten._unique2.default: "torch.unique",
    aten._unique.default: "torch.unique",
    aten.unique_dim.default: "torch.unique(dim=...)",
    aten.repeat_interleave.Tensor: "torch.repeat_interleave with tensor repeats",
    aten.argwhere.default: "torch.argwhere",
}
_ALLOC_ONLY = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
_SCALED_MM = torch.ops.aten._scaled_mm.default
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))


class CaptureError(RuntimeError):
    """An op that a graph capture cannot hold."""


def _user_line() -> str:
    """The innermost frame outside torch and graphfp8.graphs: where the offending call is."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if not path.startswith(_TORCH_DIR) and not path.startswith(_THIS_DIR):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "<unknown>"


def _check_capturable(func, args, kwargs) -> None:
    why = _HOST_SYNC.get(func)
    kind = "synchronises with the host"
    if why is None and func in _DATA_DEPENDENT:
        why, kind = _DATA_DEPENDENT[func], "has a data-dependent output shape"
    if why is None and func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            why, kind = "boolean-mask indexing", "has a data-dependent output shape"
    if why is None and func in (aten._to_copy.default, aten.copy_.default):
        src = args[1] if func is aten.copy_.default else args[0]
        dst_dev = args[0].device if func is aten.copy_.default else kwargs.get("device")
        if isinstance(src, torch.Tensor) and src.device.type == "cuda" and dst_dev is not None \
                and torch.device(dst_dev).type == "cpu":  # fmt: skip
            why, kind = "a device-to-host copy (.cpu(), .tolist(), .numpy())", "synchronises"
    if why is not None:
        raise CaptureError(
            f"graphfp8 capture: {func} ({why}) {kind}, which a captured graph cannot do; "
            f"called at {_user_line()}"
        )


def _on_device(args, kwargs) -> bool:
    """Whether any tensor argument lives off the host (the op would run on a device)."""
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
               for t in tree_flatten((args, kwargs))[0])  # fmt: skip


def _is_work(item) -> bool:
    return isinstance(item, torch.ScriptObject) and hasattr(item, "wait")


def _wait_for_work(result) -> None:
    """Waits on every c10d Work a collective returned, as torch.distributed's Python wrappers do
    with async_op=False: the tape replays the op itself, below those wrappers."""
    for item in tree_flatten(result)[0]:
        if _is_work(item):
            item.wait()


def _finished_work():
    """A c10d Work (as a collective op returns it) whose wait() does nothing."""
    done = torch.futures.Future()
    done.set_result(None)
    return _create_work_from_future(done).boxed()


def _waited(result):
    """`result` of a collective with its Work waited for now (inside the recorder, so the ops the
    wait runs are not recorded) and replaced by a finished one (module docstring)."""
    _wait_for_work(result)
    return tree_map(lambda item: _finished_work() if _is_work(item) else item, result)


class _Record:
    """One recorded op and how to replay it."""

    __slots__ = ("func", "args", "kwargs", "outs", "mode", "onednn")

    def __init__(self, func, args, kwargs, out):
        self.func, self.args, self.kwargs = func, args, kwargs
        # A CPU FP8 GEMM replays on the path it was captured on (graphfp8.ops.gemm.onednn_off).
        self.onednn = torch._C._get_mkldnn_enabled() if func is _SCALED_MM else None
        schema = func._schema
        self.outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d":
            # An in-place collective on the recorded tensors (e.g. the amax MAX all-reduce):
            # re-issued on the same tensors at the same point of the tape, and waited for, so
            # that the ops after it read the reduced values, as they did at capture.
            self.mode = "collective"
        elif func.namespace == "_c10d_functional":
            raise CaptureError(
                f"graphfp8 tape: cannot replay the functional collective {func}; use the "
                "in-place torch.distributed collectives (dist.all_reduce) inside a capture"
            )
        elif func in _ALLOC_ONLY:
            self.mode = "skip"  # a graph does not re-allocate
        elif schema.is_mutable:
            self.mode = "inplace"
        elif any(r.alias_info is not None for r in schema.returns):
            self.mode = "skip"  # views stay views of the same storage
        elif any(type(t) not in (torch.Tensor, DTensor) for t in self.outs):
            raise CaptureError(f"graphfp8 tape: cannot replay {func}, which returns a subclass")
        else:
            self.mode = "copy"

    def replay(self) -> None:
        if self.mode == "skip":
            return
        if self.onednn is False:
            with onednn_off():
                result = self.func(*self.args, **self.kwargs)
        else:
            result = self.func(*self.args, **self.kwargs)
        if self.mode == "collective":
            _wait_for_work(result)
        elif self.mode == "copy":
            fresh = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            for dst, src in zip(self.outs, fresh, strict=True):
                _local(dst).copy_(_local(src))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the op ran through DTensor's dispatch, its placements as at
    capture: an FSDP2 step's clip and optimizer on the shards), else the tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _StorageResize:
    """A recorded `UntypedStorage.resize_(nbytes)`, replayed when the size differs (as FSDP2's
    own alloc_storage / free_storage skip a resize to the size a storage has)."""

    __slots__ = ("storage", "nbytes")
    func = None

    def __init__(self, storage: torch.UntypedStorage, nbytes: int):
        self.storage, self.nbytes = storage, nbytes

    def replay(self) -> None:
        if self.storage.nbytes() != self.nbytes:
            _RESIZE(self.storage, self.nbytes)


_RESIZE = torch.UntypedStorage.resize_


@contextlib.contextmanager
def _resizes_recorded(tape: ReplayTape):
    """Records every storage resize into `tape` while the block runs."""

    def resize_(storage, nbytes):
        result = _RESIZE(storage, nbytes)
        tape.records.append(_StorageResize(storage, int(nbytes)))
        return result

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = _RESIZE


class ReplayTape:
    """The ops of one capture, replayable in order on the same tensors."""

    def __init__(self) -> None:
        self.records: list[_Record] = []

    def replay(self) -> None:
        # The records are the ops torch.autocast already chose at capture (its dispatch keys sit
        # above the recording mode): a replay under the caller's autocast must not recast them
        # again, as a CUDA graph replays kernels, not ops.
        with torch._C._DisableAutocast():
            for rec in self.records:
                rec.replay()

    def op_names(self) -> list[str]:
        """Every recorded op, e.g. 'graphfp8::cast_transpose', 'aten::_scaled_mm' (a storage
        resize: 'storage.resize_')."""
        return [rec.func._schema.name if rec.func is not None else "storage.resize_"
                for rec in self.records]  # fmt: skip


class RecordingMode(TorchDispatchMode):
    """Checks every op for capturability and, with a tape, records it."""

    def __init__(self, tape: ReplayTape | None = None):
        super().__init__()
        self.tape = tape
        self.names: list[str] = []
        self._resizes = contextlib.ExitStack()

    def __enter__(self):
        if self.tape is not None:
            self._resizes.enter_context(_resizes_recorded(self.tape))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._resizes.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A CUDA capture (no tape) holds only device work: an op on host tensors alone runs once,
        # at capture, and cannot stall the stream (torch 2.11's FSDP2 slices its DeviceMesh
        # with a CPU nonzero before each all-gather). The tape replays every op it sees.
        if self.tape is not None or _on_device(args, kwargs):
            _check_capturable(func, args, kwargs)
        out = func(*args, **kwargs)
        self.names.append(func._schema.name)
        if self.tape is not None:
            self.tape.records.append(_Record(func, args, kwargs, out))
            if func.namespace == "c10d":
                out = _waited(out)
        return out
