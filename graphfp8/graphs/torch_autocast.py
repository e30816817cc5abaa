"""The torch.autocast state a graph was captured under, compared before every replay of all three
entry points (docs/after-capture.md, "torch.autocast").

A graph replays the ops that autocast chose at capture, in the dtypes it chose then (the CPU tape
with autocast's dispatch keys excluded, graphs/tape.py; a CUDA graph replays kernels). Called
under another autocast state, an eager call would compute and return other dtypes (fp32 layers
under torch.autocast(dtype=bf16) return bf16), so a replay there would be silently different:
it raises instead. Cost per call: two torch C calls and one comparison.
"""

from __future__ import annotations

import torch

__all__ = ["AutocastState"]


def _state(device_type: str) -> torch.dtype | None:
    """The autocast dtype of `device_type`, or None outside torch.autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _text(device_type: str, dtype: torch.dtype | None) -> str:
    if dtype is None:
        return f"outside torch.autocast({device_type!r})"
    return f"under torch.autocast({device_type!r}, dtype={dtype})"


class AutocastState:
    """torch.autocast's state for the graph's device type (enabled, dtype), taken at capture.

    Args:
        device: the device of the graph's tensors; only autocast of its type changes its ops.
    """

    __slots__ = ("device_type", "dtype")

    def __init__(self, device: torch.device):
        self.device_type = torch.device(device).type
        self.dtype = _state(self.device_type)

    def check(self, name: str) -> None:
        """Raises RuntimeError unless the caller runs under the captured state; nothing has
        run yet.

        Args:
            name: what is called, for the message ("graphed callable 0 (Linear)").
        """
        now = _state(self.device_type)
        if now is not self.dtype:
            raise RuntimeError(
                f"{name}: captured {_text(self.device_type, self.dtype)}, called "
                f"{_text(self.device_type, now)}; the graph replays the ops and output dtypes "
                "of its capture, where an eager call would follow the autocast it runs in. Call "
                "it in the autocast state it was captured in (enter or leave torch.autocast "
                "around the call), or capture it again in this one"
            )
