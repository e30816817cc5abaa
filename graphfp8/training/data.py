"""Training and validation batches from a token stream: a deterministic split, seeded training
windows (each rank its own shard of every batch) and a fixed validation set.

    data = Dataset(open_stream("stdlib"), val_fraction=0.01)
    data.check_seq_len(64)
    tokens = data.train_batch(step, microbatch, batch=8, seq_len=64)   # (8, 65) int64
    for tokens, weights in data.val_batches(64, batch=8, max_batches=4): ...

The split is a tail split: the first (1 - val_fraction) of the stream trains, the rest
validates, so no training window overlaps a validation token. Training windows start anywhere in
the training part, drawn from a generator seeded by (seed, step, microbatch): a resumed run sees
exactly the batches it would have seen. Data parallel, the draw is one global batch of
batch x world windows and rank r takes rows [r * batch, (r + 1) * batch): N ranks train on the
windows that one rank with N times the batch would. The validation set is the same for every
world size: up to max_batches x batch windows of seq_len + 1 tokens, evenly spaced over the
validation part (consecutive windows share one token), dealt out to the ranks round-robin.

Packed (--pack): the stream's files are its documents, and every window (training and
validation alike) comes with the segment of each token, its document counted from the window's
first (graphfp8.ops.segments): attention stays within a document, and the first token of a
document is not predicted from the one before it (its target is -100, which the loss ignores).
"""

from __future__ import annotations

import math

import torch

from graphfp8.training.sources import DataError, TokenStream

__all__ = ["Dataset", "IGNORE", "split_windows"]

IGNORE = -100  # a target the loss skips (F.cross_entropy's ignore_index)


def split_windows(tokens: torch.Tensor, segments: torch.Tensor | None = None):
    """Inputs, targets and the inputs' segments of windows.

    Args:
        tokens: (b, S + 1) int64 windows.
        segments: their (b, S + 1) segments (packed), or None.

    Returns:
        (inputs (b, S), targets (b, S), segments (b, S) or None): a target that starts another
        document than its input's is IGNORE.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if segments is None:
        return inputs, targets, None
    targets = targets.masked_fill(segments[:, 1:] != segments[:, :-1], IGNORE)
    return inputs, targets, segments[:, :-1]


class Dataset:
    """A token stream split into a training and a validation part.

    Args:
        stream: the tokens (training/sources.py).
        val_fraction: the share of the stream, at its end, that validates (0: no validation).
        pack: windows come with their documents' segments (the stream's files).
    """

    def __init__(self, stream: TokenStream, val_fraction: float = 0.01, pack: bool = False):
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"--val-fraction must be in [0, 1), got {val_fraction}")
        if pack and stream.documents < 2:
            raise DataError(
                f"--pack: --data {stream.info['source']} is one document; packing needs "
                "document boundaries: a folder of files or stdlib (each file a document)"
            )
        self.stream, self.val_fraction, self.pack = stream, val_fraction, pack
        self.val_tokens = math.floor(len(stream) * val_fraction)
        self.train_tokens = len(stream) - self.val_tokens
        self._val_cache: dict[tuple, list] = {}

    @property
    def vocab_size(self) -> int:
        return self.stream.vocab_size

    @property
    def has_validation(self) -> bool:
        return self.val_fraction > 0

    def describe(self) -> dict:
        """What summary.json and checkpoints record about the data."""
        packed = {"pack": True} if self.pack else {}
        return {**self.stream.info, "val_fraction": self.val_fraction,
                "train_tokens": self.train_tokens, "val_tokens": self.val_tokens,
                **packed}  # fmt: skip

    def check_seq_len(self, seq_len: int) -> None:
        """Raises DataError unless a window of seq_len + 1 tokens fits in each part."""
        need = seq_len + 1
        source = self.stream.info["source"]
        if self.train_tokens < need:
            raise DataError(f"--seq-len {seq_len}: a sequence needs {need} tokens, the training "
                            f"part of --data {source} holds {self.train_tokens}")  # fmt: skip
        if self.has_validation and self.val_tokens < need:
            raise DataError(
                f"--seq-len {seq_len}: a sequence needs {need} tokens, the validation part of "
                f"--data {source} holds {self.val_tokens} ({self.val_fraction:g} of "
                f"{len(self.stream)}); raise --val-fraction or pass --val-fraction 0"
            )

    def train_batch(self, step: int, microbatch: int, batch: int, seq_len: int, seed: int = 0,
                    rank: int = 0, world: int = 1) -> torch.Tensor:  # fmt: skip
        """This rank's windows of one microbatch; a pure function of its arguments.

        Returns:
            (batch, seq_len + 1) int64 on the CPU: inputs are [:, :-1], targets [:, 1:].
        """
        starts = self._train_starts(step, microbatch, batch, seq_len, seed, rank, world)
        return self.stream.windows(starts, seq_len + 1)

    def train_segments(self, step: int, microbatch: int, batch: int, seq_len: int, seed: int = 0,
                       rank: int = 0, world: int = 1) -> torch.Tensor:  # fmt: skip
        """The segments of train_batch's windows (same arguments): (batch, seq_len + 1) int64,
        each token's document counted from its window's first."""
        starts = self._train_starts(step, microbatch, batch, seq_len, seed, rank, world)
        return self._segments(starts, seq_len + 1)

    def _train_starts(self, step, microbatch, batch, seq_len, seed, rank, world) -> list[int]:
        if self.train_tokens <= seq_len:
            self.check_seq_len(seq_len)
        g = torch.Generator().manual_seed(hash((seed, step, microbatch)) & (2**63 - 1))
        starts = torch.randint(0, self.train_tokens - seq_len, (batch * world,), generator=g)
        return starts[rank * batch : (rank + 1) * batch].tolist()

    def _segments(self, starts: list[int], length: int) -> torch.Tensor:
        docs = self.stream.document_ids(starts, length)
        return docs - docs[:, :1]

    def val_starts(self, seq_len: int, max_windows: int) -> list[int]:
        """Start offsets of the validation set: at most max_windows windows, evenly spaced."""
        available = (self.val_tokens - 1) // seq_len
        count = min(available, max_windows)
        return [self.train_tokens + (i * available // count) * seq_len for i in range(count)]

    def val_batches(self, seq_len: int, batch: int, max_batches: int, rank: int = 0,
                    world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """This rank's share of the validation set, in batches of at most `batch` windows. Every
        rank gets the same number of windows (collectives need it): a short share is padded with
        repeats of weight 0.

        Returns:
            [(tokens (b, seq_len + 1) int64, weights (b,) float32)], CPU tensors; packed,
            [(tokens, weights, segments (b, seq_len + 1) int64)].
        """
        key = (seq_len, batch, max_batches, rank, world)
        if key not in self._val_cache:
            self.check_seq_len(seq_len)
            starts = self.val_starts(seq_len, max_batches * batch)
            mine = starts[rank::world]
            share = math.ceil(len(starts) / world)
            weights = [1.0] * len(mine) + [0.0] * (share - len(mine))
            mine = mine + [starts[0]] * (share - len(mine))
            self._val_cache[key] = [
                (self.stream.windows(mine[i : i + batch], seq_len + 1),
                 torch.tensor(weights[i : i + batch], dtype=torch.float32),
                 *([self._segments(mine[i : i + batch], seq_len + 1)] if self.pack else []))
                for i in range(0, share, batch)
            ]  # fmt: skip
        return self._val_cache[key]
