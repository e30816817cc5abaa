"""Where the training text comes from: files memory-mapped as one token stream.

    stream = open_stream("stdlib")                       # the standard library's .py files
    stream = open_stream("notes.txt")                    # a UTF-8 text file or folder, as bytes
    stream = open_stream("train.bin", vocab_size=50304)  # nanoGPT's uint16 token file
    stream = open_stream("llama.bin", vocab_size=128256) # uint32 tokens (vocab > 65536)
    stream = open_stream("synthetic")                    # the generated language (tests)
    windows = stream.windows([0, 100], 65)               # (2, 65) int64 tokens

A stream is its files concatenated in a fixed order. Opening one lists and stats the files and
reads nothing else: each file is memory-mapped (torch.from_file) the first time a window touches
it, so a multi-GB token file costs address space, not RAM, and the standard library (~1,000
files) opens in a fraction of a second.

A folder's files are ordered by a hash of their path inside the folder, not alphabetically: the
validation split takes the end of the stream, which is then a sample of files from all over the
folder rather than its alphabetically last package.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from graphfp8.training.presets import BYTE_VOCAB
from graphfp8.training.synthetic import make_corpus

__all__ = [
    "BYTE_VOCAB",
    "DataError",
    "TokenStream",
    "open_stream",
    "stdlib_stream",
    "token_dtype",
]

TOKEN_SUFFIX = ".bin"
# Standard library folders left out: tests (not installed by every distribution), installed
# packages and caches; `config-*` and `_sysconfigdata*` describe the local build, not the library.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


class DataError(ValueError):
    """--data cannot be used as given: a missing path, an empty or malformed file, tokens out of
    the vocabulary, or sequences longer than the data."""


@dataclass(frozen=True)
class DataFile:
    path: Path
    tokens: int


class TokenStream:
    """Files, or one in-memory tensor, seen as one sequence of tokens.

    Args:
        files: the files in stream order (empty when `memory` is given).
        dtype: torch.uint8 for bytes, torch.uint16 or torch.uint32 for token files.
        vocab_size: every token must be below it.
        info: what summary.json records about the source (JSON-serialisable).
        memory: (N,) tensor of tokens held in memory instead of files.
    """

    def __init__(self, files: list[DataFile], dtype: torch.dtype, vocab_size: int, info: dict,
                 memory: torch.Tensor | None = None):  # fmt: skip
        self.files, self.dtype, self.vocab_size = files, dtype, vocab_size
        self._mapped: dict[int, torch.Tensor] = {}
        sizes = [f.tokens for f in files]
        if memory is not None:
            self._mapped[0], sizes = memory, [memory.numel()]
        self._offsets = list(itertools.accumulate(sizes, initial=0))
        self.info = {**info, "tokens": len(self), "vocab_size": vocab_size}

    def __len__(self) -> int:
        return self._offsets[-1]

    def _segment(self, i: int) -> torch.Tensor:
        """File i's tokens, mapped on first use: (tokens,) uint8, uint16 or uint32."""
        seg = self._mapped.get(i)
        if seg is None:
            f = self.files[i]
            seg = torch.from_file(str(f.path), shared=False, size=f.tokens, dtype=self.dtype)
            self._mapped[i] = seg
        return seg

    def read(self, start: int, length: int) -> torch.Tensor:
        """Tokens [start, start + length) of the stream, across file boundaries: (length,) int64."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside a stream of {len(self)}")
        i = bisect.bisect_right(self._offsets, start) - 1
        parts = []
        while length > 0:
            seg, lo = self._segment(i), start - self._offsets[i]
            take = min(length, seg.numel() - lo)
            parts.append(seg[lo : lo + take].long())
            start, length, i = start + take, length - take, i + 1
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    def windows(self, starts: list[int], length: int) -> torch.Tensor:
        """The windows [s, s + length) for s in starts, checked against the vocabulary.

        Returns:
            (len(starts), length) int64 on the CPU.
        """
        if len(self._offsets) == 2:  # one file: a single gather
            idx = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(length)
            out = self._segment(0)[idx].long()
        else:
            out = torch.stack([self.read(s, length) for s in starts])
        if self.vocab_size < torch.iinfo(self.dtype).max + 1:
            self._check_vocab(out, starts)
        return out

    @property
    def documents(self) -> int:
        """How many documents (files) the stream holds; one for an in-memory stream."""
        return len(self._offsets) - 1

    def document_ids(self, starts: list[int], length: int) -> torch.Tensor:
        """The document (file index) of every token of the windows [s, s + length).

        Returns:
            (len(starts), length) int64 on the CPU.
        """
        boundaries = torch.tensor(self._offsets[1:-1], dtype=torch.int64)
        positions = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(length)
        return torch.searchsorted(boundaries, positions, right=True)

    def _check_vocab(self, windows: torch.Tensor, starts: list[int]) -> None:
        bad = windows >= self.vocab_size
        if not bool(bad.any()):
            return
        row, col = (int(i) for i in bad.nonzero()[0])
        offset = starts[row] + col
        i = bisect.bisect_right(self._offsets, offset) - 1
        where = f"{self.files[i].path} at token {offset - self._offsets[i]}" if self.files else ""
        raise DataError(
            f"token {int(windows[row, col])} ({where}) is out of --vocab-size {self.vocab_size}: "
            "pass the vocabulary size the file was tokenized with"
        )


def _list_files(root: Path, skip_dirs=frozenset(), suffix: str | None = None) -> list[Path]:
    """Regular files under root (hidden ones and `skip_dirs` left out), in the fixed hash order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        found += [Path(dirpath, n) for n in filenames
                  if not n.startswith(".") and (suffix is None or n.endswith(suffix))]  # fmt: skip
    key = lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest()
    return sorted(found, key=key)


def _sized(paths: list[Path], root: Path) -> tuple[list[DataFile], str]:
    """The non-empty files with their sizes, and a fingerprint of (path, size) in order."""
    files, digest = [], hashlib.sha1()
    for path in paths:
        size = path.stat().st_size
        if size:
            files.append(DataFile(path, size))
            digest.update(f"{path.relative_to(root).as_posix()}\t{size}\n".encode())
    return files, digest.hexdigest()[:16]


def stdlib_stream() -> TokenStream:
    """The .py files of this interpreter's standard library, as bytes, in the fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in _list_files(root, _STDLIB_SKIP_DIRS, ".py")
             if not p.name.startswith("_sysconfigdata")
             and not p.relative_to(root).parts[0].startswith("config-")]  # fmt: skip
    files, fingerprint = _sized(paths, root)
    if not files:
        raise DataError(f"--data stdlib: no .py files under {root}; pass --data PATH")
    info = {"source": "stdlib", "python": platform.python_version(),
            "implementation": platform.python_implementation(), "root": str(root),
            "files": len(files), "fingerprint": fingerprint}  # fmt: skip
    return TokenStream(files, torch.uint8, BYTE_VOCAB, info)


def _text_stream(path: Path) -> TokenStream:
    if path.is_dir():
        paths = _list_files(path)
        tokens = [p for p in paths if p.name.endswith(TOKEN_SUFFIX)]
        if tokens:
            raise DataError(f"--data {path}: the folder holds {TOKEN_SUFFIX} token files "
                            f"({tokens[0].name}); pass one of them with --vocab-size")  # fmt: skip
        files, fingerprint = _sized(paths, path)
        if not files:
            raise DataError(f"--data {path}: the folder holds no non-empty files")
        info = {"source": "text", "path": str(path), "files": len(files),
                "fingerprint": fingerprint}  # fmt: skip
        return TokenStream(files, torch.uint8, BYTE_VOCAB, info)
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"--data {path}: the file is empty")
    return TokenStream([DataFile(path, size)], torch.uint8, BYTE_VOCAB,
                       {"source": "text", "path": str(path), "files": 1})  # fmt: skip


def token_dtype(vocab_size: int) -> torch.dtype:
    """The element type of a .bin token file of this vocabulary: uint16 (nanoGPT's layout) up to
    65536 tokens, uint32 above (Llama 3's 128256), as docs/training.md says."""
    if not 1 <= vocab_size <= 1 << 32:
        raise DataError(f"--vocab-size {vocab_size}: token files hold tokens below 2**32")
    return torch.uint16 if vocab_size <= 1 << 16 else torch.uint32


def _token_stream(path: Path, vocab_size: int | None) -> TokenStream:
    size = path.stat().st_size
    if vocab_size is None:
        raise DataError(f"--data {path}: a {TOKEN_SUFFIX} token file needs --vocab-size")
    dtype = token_dtype(vocab_size)
    width = dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    if size == 0:
        raise DataError(f"--data {path}: the file is empty")
    if size % width:
        raise DataError(f"--data {path}: {size} bytes is not a whole number of {name} tokens "
                        f"({width} bytes each, for --vocab-size {vocab_size}): the file is "
                        "truncated or not a token file")  # fmt: skip
    return TokenStream([DataFile(path, size // width)], dtype, vocab_size,
                       {"source": "tokens", "path": str(path), "files": 1,
                        "token_dtype": name})  # fmt: skip


def open_stream(spec: str, vocab_size: int | None = None, synthetic_bytes: int = 1 << 20,
                seed: int = 0) -> TokenStream:  # fmt: skip
    """Opens `--data`: "stdlib", "synthetic", a text file or folder, or a .bin token file.

    Args:
        spec: the --data argument (a path named "stdlib" or "synthetic" is written ./stdlib).
        vocab_size: the tokenizer's vocabulary size; only for .bin token files.
        synthetic_bytes: size of the generated corpus ("synthetic").
        seed: seed of the generated corpus ("synthetic").
    """
    path = Path(spec)
    is_tokens = spec not in ("stdlib", "synthetic") and path.suffix == TOKEN_SUFFIX
    if vocab_size is not None and not is_tokens:
        raise DataError(f"--vocab-size is for {TOKEN_SUFFIX} token files; --data {spec} is read "
                        f"as bytes (vocabulary {BYTE_VOCAB})")  # fmt: skip
    if spec == "stdlib":
        return stdlib_stream()
    if spec == "synthetic":
        corpus = make_corpus(synthetic_bytes, seed=seed)
        return TokenStream([], torch.uint8, BYTE_VOCAB, {"source": "synthetic", "seed": seed},
                           memory=corpus)  # fmt: skip
    if not path.exists():
        raise DataError(f"--data {spec}: no such file or folder")
    return _token_stream(path, vocab_size) if is_tokens else _text_stream(path)
