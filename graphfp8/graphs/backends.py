"""Graph backends: CUDA graphs on the GPU, the replay tape on the CPU. Both expose the same small
interface - capture as a context manager, replay, and the list of what was captured."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from graphfp8 import global_state
from graphfp8.fp8.scale_schedule import SCHEDULE
from graphfp8.graphs.tape import RecordingMode, ReplayTape

__all__ = ["CudaGraph", "TapeGraph", "capture_stream", "capturing", "host_memory", "new_graph",
           "tape_replays_off", "tapes_allocate_as_cuda"]  # fmt: skip

_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
global_state.register("capture streams (graphs/backends.py)", _CAPTURE_STREAMS.clear,
                      lambda: not _CAPTURE_STREAMS, layer=global_state.GRAPHS)  # fmt: skip


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream that warms up and captures on `device`. Warmup and capture must share it:
    an AccumulateGrad node made during warmup that is still alive at capture would otherwise
    sit on another stream, and the backward capture would sync with a stream that is not
    capturing (cudaErrorStreamCaptureInvalidated)."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


_KERNEL_NODE = re.compile(r"\{KERNEL\s*\|\s*\{ID \|[^|]*\|\s*([^\\}|]+)")
# The type of every node of a debug dump's record labels (KERNEL, MEMSET, MEMCPY, EMPTY, ...).
_NODE_TYPE = re.compile(r'label="\{\s*([A-Z_]+)\s*\|')


class _TapeReplays:
    """Whether CPU tapes replay their ops (tape_replays_off) and hold what they record
    (tapes_allocate_as_cuda)."""

    on = True
    record = True


@contextlib.contextmanager
def tape_replays_off():
    """Inside the block CPU tapes skip their recorded ops: a call of a graphed callable, microbatch
    or step runs all its host-side work (checks, copies, bookkeeping, autograd) and no kernel. What
    the host benchmark times (`python -m benchmarks host`) and the host-cost test counts; the
    values the graphs hold are meaningless afterwards."""
    _TapeReplays.on = False
    try:
        yield
    finally:
        _TapeReplays.on = True


@contextlib.contextmanager
def tapes_allocate_as_cuda():
    """Inside the block CPU captures run their ops without recording them and replays run
    nothing: a capture allocates and frees as a CUDA capture does in its graph's pool (a tape
    would hold every tensor it recorded) and a replay allocates nothing, as a CUDA graph's. What
    the CPU accounting of graphfp8-train's memory runs under (benchmarks/memory_plan.py,
    docs/sharding.md "Memory planner"); the graphs compute nothing afterwards."""
    _TapeReplays.on = _TapeReplays.record = False
    try:
        yield
    finally:
        _TapeReplays.on = _TapeReplays.record = True


@contextlib.contextmanager
def host_memory():
    """What the block allocates is host memory beside the device's (a capture's pinned copy of
    the model: graphs/step_optim.py TrainingSnapshot). Under tapes_allocate_as_cuda the CPU
    stands in for a GPU, so the block runs outside the dispatch modes that count its memory
    (graphfp8.memory.LiveBytes): a GPU would not hold it. Elsewhere it changes nothing."""
    if _TapeReplays.record:
        yield
        return
    with _disable_current_modes():
        yield


def capturing() -> bool:
    """Whether a graph capture is recording on this thread: a CPU tape's or a CUDA graph's (both
    run under the RecordingMode), or any CUDA stream capture on the current device."""
    if any(isinstance(m, RecordingMode) for m in _get_current_dispatch_mode_stack()):
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TapeGraph:
    """CPU backend: a ReplayTape."""

    def __init__(self) -> None:
        self.tape = ReplayTape()
        self.op_names: list[str] = []
        self.updates: tuple = ()  # the scale updates the capture recorded (session.capture_into)
        self.released = False

    @contextlib.contextmanager
    def capture(self, pool=None):
        mode = RecordingMode(self.tape if _TapeReplays.record else None)
        with mode:
            yield
        self.op_names = mode.names

    def replay(self) -> None:
        if _TapeReplays.on:
            self.tape.replay()
        SCHEDULE.replayed(self.updates)

    def kernels(self) -> list[str]:
        return self.tape.op_names()

    def nodes(self) -> list[tuple[str, str]]:
        """("OP", name) for every recorded op."""
        return [("OP", name) for name in self.tape.op_names()]

    def release(self) -> None:
        """Drops the recorded ops and the tensors they hold."""
        self.tape = ReplayTape()
        self.released = True


class CudaGraph:
    """GPU backend: a torch.cuda.CUDAGraph kept (keep_graph=True) in debug mode, so that its kernel
    nodes can be listed; the recording mode checks every op during capture. With the environment
    variable GRAPHFP8_GRAPH_DEBUG=0 at capture, neither (captured_kernels() then raises): what
    `bench step` compares, to see whether debug mode costs launch time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.debug = os.environ.get("GRAPHFP8_GRAPH_DEBUG", "1") != "0"
        self.graph = torch.cuda.CUDAGraph(keep_graph=self.debug)
        if self.debug:
            self.graph.enable_debug_mode()
        self.op_names: list[str] = []
        self.updates: tuple = ()  # the scale updates the capture recorded (session.capture_into)
        self.released = False

    @contextlib.contextmanager
    def capture(self, pool=None):
        mode = RecordingMode(None)
        with (
            torch.cuda.device(self.device),
            torch.cuda.graph(self.graph, pool=pool, stream=capture_stream(self.device)),
        ):
            with mode:
                yield
        self.op_names = mode.names
        if self.debug:  # keep_graph=True: instantiated here; otherwise at the end of capture
            self.graph.instantiate()

    def replay(self) -> None:
        self.graph.replay()
        SCHEDULE.replayed(self.updates)

    def release(self) -> None:
        """Destroys the CUDA graph; its memory pool is freed once no graph or tensor uses it."""
        self.graph.reset()
        self.released = True

    def _dump(self) -> str:
        if not self.debug:
            raise RuntimeError(
                "graphfp8: this graph was captured with GRAPHFP8_GRAPH_DEBUG=0 (no debug mode), so "
                "its kernel nodes cannot be listed; capture it without that variable"
            )
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "graph.dot")
            self.graph.debug_dump(path)
            with open(path) as f:
                return f.read()

    def kernels(self) -> list[str]:
        """Kernel nodes of the graph, in dump order (demangled when c++filt is available)."""
        return _demangle([m.group(1).strip() for m in _KERNEL_NODE.finditer(self._dump())])

    def nodes(self) -> list[tuple[str, str]]:
        """(type, name) of every node: ("KERNEL", kernel name), ("MEMSET", ""), ("MEMCPY", ""),
        ...; kernel names as kernels() gives them."""
        dump = self._dump()
        types = [m.group(1) for m in _NODE_TYPE.finditer(dump)]
        kernels = _demangle([m.group(1).strip() for m in _KERNEL_NODE.finditer(dump)])
        if types.count("KERNEL") != len(kernels):  # another label layout: count the type words
            types = ["KERNEL"] * len(kernels) + [t for t in ("MEMSET", "MEMCPY")
                                                 for _ in range(dump.count("{" + t))]  # fmt: skip
        names = iter(kernels)
        return [(t, next(names, "?") if t == "KERNEL" else "") for t in types]


def _demangle(names: list[str]) -> list[str]:
    """The names demangled when c++filt is available."""
    cxxfilt = shutil.which("c++filt")
    if cxxfilt and names:
        out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
        if out.returncode == 0:
            names = out.stdout.splitlines()
    return names


def new_graph(device: torch.device):
    return CudaGraph(device) if device.type == "cuda" else TapeGraph()
