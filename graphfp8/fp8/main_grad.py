"""The fp32 main gradient that weight-gradient GEMMs accumulate into (fuse_wgrad_accumulation).

TransformerEngine's convention (Megatron's): a weight carries `main_grad`, an fp32 tensor of its
shape on its device; with fuse_wgrad_accumulation=True the weight-gradient GEMM adds dW into it
(main_grad += dW, no separate add pass) and autograd gets no gradient for the weight (.grad
stays as it was). A weight carrying `grad_added_to_main_grad` has it set to True by each
backward that added into main_grad (docs/fp8.md, "Weight-gradient accumulation").

The layers mark each such weight (`mark`), so that the graphs leave it out of the gradients they
fold into .grad and put its main_grad back after warmup and capture (graphs/). A capture records
the weights its backward added into (`recording`): its replays are refused once one of their
main_grads is replaced, and set their flags again (graphs/main_grad_guard.py).
"""

from __future__ import annotations

import contextlib

import torch

from graphfp8.fp8.block_tensor import Float8BlockTensor

__all__ = [
    "MainGradSnapshot", "added", "check_main_grad", "is_fused", "layer_main_grads", "main_grads",
    "mark", "recording", "route_to_main_grad",
]  # fmt: skip

# The attribute a layer with fuse_wgrad_accumulation=True sets on each of its GEMM weights.
_MARK = "_graphfp8_fuse_wgrad"
_FLAG = "grad_added_to_main_grad"  # TE's (Megatron's) attribute
# The open recordings (`recording`): ({id(weight): weight}, {id(weight): its flag before}).
_RECORDINGS: list[tuple[dict[int, torch.Tensor], dict[int, object]]] = []
_ABSENT = object()  # a weight without the flag


def mark(weight: torch.Tensor, on: bool) -> None:
    """Marks (or unmarks) `weight` as one whose gradient goes into its main_grad."""
    setattr(weight, _MARK, bool(on))


def is_fused(weight: torch.Tensor) -> bool:
    """Whether a layer accumulates `weight`'s gradient into weight.main_grad."""
    return bool(getattr(weight, _MARK, False))


def main_grads(params) -> list[torch.Tensor]:
    """The distinct main_grad tensors that the parameters among `params` hold."""
    out: dict[int, torch.Tensor] = {}
    for p in params:
        g = getattr(p, "main_grad", None)
        if isinstance(g, torch.Tensor):
            out.setdefault(id(g), g)
    return list(out.values())


class MainGradSnapshot:
    """The parameters' main_grad tensors, put back after a graph's warmup and CPU capture (whose
    tape runs what it records): the snapshot of graphs/session.py's CaptureSession. The copy
    lives in host memory."""

    def __init__(self, params) -> None:
        self.tensors = main_grads(params)
        with torch.no_grad():
            self.saved = [t.detach().to("cpu", copy=True) for t in self.tensors]

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self.tensors, self.saved, strict=True):
                t.copy_(saved)


def check_main_grad(weight: torch.Tensor, layer: str, name: str) -> torch.Tensor:
    """weight.main_grad, checked: an fp32 tensor of the weight's shape on its device, contiguous.
    Raises (before the forward changes any state) with the fix in the message."""
    where = f"{layer}(fuse_wgrad_accumulation=True): weight '{name}'"
    g = getattr(weight, "main_grad", None)
    if g is None:
        raise RuntimeError(
            f"{where} has no main_grad: give it one before the forward, e.g. "
            f"weight.main_grad = torch.zeros_like(weight, dtype=torch.float32), or build the "
            f"layer with fuse_wgrad_accumulation=False"
        )
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{where}: main_grad must be a torch.Tensor, got {type(g).__name__}")
    if g.dtype != torch.float32:
        raise TypeError(
            f"{where}: main_grad must be float32 (the GEMM accumulates in fp32), got {g.dtype}"
        )
    if g.shape != weight.shape:
        raise ValueError(
            f"{where}: main_grad has shape {tuple(g.shape)}, the weight {tuple(weight.shape)}"
        )
    if g.device != weight.device:
        raise ValueError(f"{where}: main_grad is on {g.device}, the weight on {weight.device}")
    if not g.is_contiguous() or g.requires_grad:
        raise ValueError(
            f"{where}: main_grad must be a contiguous tensor that does not require grad"
        )
    if g.data_ptr() % 16:  # cuBLASLt's FP8 GEMMs: checked on every device (ops/gemm.py)
        raise ValueError(
            f"{where}: main_grad must start at a 16-byte aligned address (the GEMM writes it), "
            f"got one {g.data_ptr() % 16} bytes past: a view into a flat gradient buffer should "
            "start at a multiple of 4 elements"
        )
    return g


def layer_main_grads(layer, weights) -> list[torch.Tensor | None]:
    """Marks a layer's GEMM weights by its fuse_wgrad_accumulation (the graphs read the mark)
    and returns, per (name, weight), the checked main_grad where the gradient goes there (the
    option on, grad enabled, the weight trainable), else None. Raises before any state changes."""
    on, name = layer.fuse_wgrad_accumulation, type(layer).__name__
    out = []
    for key, w in weights:
        mark(w, on)
        if not (on and torch.is_grad_enabled() and w.requires_grad):
            out.append(None)
            continue
        if isinstance(w, Float8BlockTensor):
            raise NotImplementedError(
                f"{name}(fuse_wgrad_accumulation=True): blockwise FP8 primary weights "
                "(fp8_model_init under Float8BlockScaling) do not accumulate into a main_grad; "
                "create the model outside fp8_model_init or turn the option off"
            )
        out.append(check_main_grad(w, name, key))
    return out


def added(weight: torch.Tensor) -> None:
    """Sets TE's `grad_added_to_main_grad` flag where the weight carries one (Megatron's DDP
    reads it), and notes the weight in the open recordings. A Python attribute: a graph replay
    sets it after its backward (graphs/main_grad_guard.py; docs/fp8.md)."""
    for weights, flags in _RECORDINGS:
        if id(weight) not in weights:
            weights[id(weight)] = weight
            flags[id(weight)] = getattr(weight, _FLAG, _ABSENT)
    if hasattr(weight, _FLAG):
        weight.grad_added_to_main_grad = True


@contextlib.contextmanager
def recording():
    """Yields {id(weight): weight} of the weights whose gradient the block added into their
    main_grad (a capture's warmup and backward); puts their `grad_added_to_main_grad` flags
    back as they were before the block, as a capture puts back their main_grads."""
    weights: dict[int, torch.Tensor] = {}
    flags: dict[int, object] = {}
    entry = (weights, flags)
    _RECORDINGS.append(entry)
    try:
        yield weights
    finally:
        del _RECORDINGS[next(i for i, e in enumerate(_RECORDINGS) if e is entry)]
        for key, flag in flags.items():
            if flag is not _ABSENT:  # the weight had the flag: its value before the block
                setattr(weights[key], _FLAG, flag)


class _IntoMainGrad(torch.autograd.Function):
    """Identity on the weight whose backward adds the gradient into main_grad (fp32) and gives
    autograd none: the high-precision and blockwise paths' form of the fused accumulation."""

    @staticmethod
    def forward(ctx, weight, main_grad):
        ctx.weight, ctx.main_grad = weight, main_grad
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, dw):
        ctx.main_grad.add_(dw.float())
        added(ctx.weight)
        return None, None


def route_to_main_grad(weight: torch.Tensor, main_grad: torch.Tensor | None) -> torch.Tensor:
    """`weight` as is (main_grad None), else a view of it whose gradient goes into main_grad."""
    if main_grad is None:
        return weight
    return _IntoMainGrad.apply(weight, main_grad)
