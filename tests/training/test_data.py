"""graphfp8-train's data: byte and token files, folders and the standard library as one
memory-mapped stream, the deterministic split, rank shards, the validation set, clear errors."""

from __future__ import annotations

import array
import platform
import random

import pytest
import torch

from graphfp8.testing import assert_bitwise_equal
from graphfp8.training.data import Dataset
from graphfp8.training.sources import DataError, open_stream
from graphfp8.training.synthetic import make_corpus


def _write_tokens(path, tokens: list[int]) -> None:
    """A nanoGPT token file: native-endian uint16."""
    path.write_bytes(array.array("H", tokens).tobytes())


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A byte file of 6000 random bytes (every 16-byte window occurs once)."""
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_bytes(random.Random(0).randbytes(6000))
    return path


def test_corpus_is_deterministic():
    a, b = make_corpus(4096, seed=3), make_corpus(4096, seed=3)
    assert_bitwise_equal(a, b)
    assert not torch.equal(a, make_corpus(4096, seed=4))


def test_byte_file_batches_are_the_bytes_at_their_offsets(text):
    raw = text.read_bytes()
    data = Dataset(open_stream(str(text)), val_fraction=0.1)
    assert (data.train_tokens, data.val_tokens, data.vocab_size) == (5400, 600, 256)
    for step in range(20):
        rows = data.train_batch(step, 1, batch=4, seq_len=31)
        assert rows.shape == (4, 32) and rows.dtype == torch.int64
        for row in rows.tolist():
            start = raw.find(bytes(row))
            assert start >= 0 and start + 32 <= data.train_tokens, "window outside the train part"
    assert_bitwise_equal(data.train_batch(7, 2, 4, 31), data.train_batch(7, 2, 4, 31))
    assert not torch.equal(data.train_batch(7, 2, 4, 31), data.train_batch(8, 2, 4, 31))


def test_token_file_round_trip_and_split(tmp_path):
    """Token i of the file is i: a window is the run of integers from its offset."""
    path = tmp_path / "train.bin"
    _write_tokens(path, list(range(4000)))
    data = Dataset(open_stream(str(path), vocab_size=4000), val_fraction=0.05)
    assert (data.train_tokens, data.val_tokens, data.vocab_size) == (3800, 200, 4000)
    for step in range(20):
        for row in data.train_batch(step, 0, batch=8, seq_len=15):
            assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 16))
            assert int(row[-1]) < data.train_tokens
    starts = data.val_starts(seq_len=15, max_windows=100)
    assert starts == [3800 + 15 * i for i in range(13)]  # (200 - 1) // 15 windows, all of them
    (tokens, weights), *_ = data.val_batches(15, batch=4, max_batches=100)
    assert torch.equal(tokens[1], torch.arange(3815, 3831)) and weights.tolist() == [1.0] * 4


def test_ranks_read_their_shard_of_one_global_batch(text):
    data = Dataset(open_stream(str(text)), val_fraction=0.1)
    whole = data.train_batch(3, 1, batch=6, seq_len=15)
    shards = [data.train_batch(3, 1, batch=3, seq_len=15, rank=r, world=2) for r in range(2)]
    assert_bitwise_equal(torch.cat(shards), whole)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_validation_set_is_fixed_and_shared_out(text, world):
    """Every rank gets the same number of windows; the weight-1 windows of all ranks are the
    validation set, each once, whatever the world size."""
    data = Dataset(open_stream(str(text)), val_fraction=0.1)
    full = data.val_starts(31, max_windows=5 * 2)
    assert len(full) == 10 and full[0] >= data.train_tokens and full[-1] + 32 <= 6000
    seen, sizes = [], set()
    for rank in range(world):
        batches = data.val_batches(31, batch=2, max_batches=5, rank=rank, world=world)
        sizes.add(sum(w.numel() for _, w in batches))
        for tokens, weights in batches:
            seen += [tuple(t) for t, w in zip(tokens.tolist(), weights, strict=True) if w == 1]
    expected = [tuple(data.stream.read(s, 32).tolist()) for s in full]
    assert len(sizes) == 1 and sorted(seen) == sorted(expected)


def test_folder_is_its_files_in_a_fixed_order(tmp_path):
    contents = {"a.txt": b"alpha\n", "b.md": b"beta beta\n", "sub/c.py": b"gamma = 3\n",
                "empty.txt": b"", ".hidden": b"secret", ".git/x": b"objects"}  # fmt: skip
    for name, body in contents.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(body)
    stream = open_stream(str(tmp_path))
    names = sorted(f.path.relative_to(tmp_path).as_posix() for f in stream.files)
    assert names == ["a.txt", "b.md", "sub/c.py"]
    whole = b"".join(f.path.read_bytes() for f in stream.files)
    assert bytes(stream.read(0, len(stream)).tolist()) == whole
    assert bytes(stream.windows([4, 9], 6).flatten().tolist()) == whole[4:10] + whole[9:15]
    again = open_stream(str(tmp_path))
    assert [f.path for f in again.files] == [f.path for f in stream.files]
    assert again.info["fingerprint"] == stream.info["fingerprint"]


def test_stdlib_corpus_is_found_and_real():
    stream = open_stream("stdlib")
    assert stream.info["python"] == platform.python_version()
    assert stream.info["files"] > 100 and len(stream) > 1_000_000
    assert not any("site-packages" in f.path.parts or "test" in f.path.parts
                   for f in stream.files)  # fmt: skip
    text = bytes(stream.read(len(stream) // 2, 20000).tolist())
    assert b"def " in text and b"import " in text
    assert open_stream("stdlib").info["fingerprint"] == stream.info["fingerprint"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/statm")
def test_token_file_is_memory_mapped(tmp_path):
    """A 512 MiB token file (sparse: no disk) opens, trains and validates within 48 MiB."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:
        f.truncate(512 << 20)
    before = _rss_bytes()
    data = Dataset(open_stream(str(path), vocab_size=50304), val_fraction=0.01)
    data.check_seq_len(1024)
    assert data.train_batch(0, 0, batch=8, seq_len=1024).shape == (8, 1025)
    assert len(data.val_batches(1024, batch=8, max_batches=4)) == 4
    assert len(data.stream) == 256 << 20
    assert _rss_bytes() - before < 48 << 20


@pytest.mark.parametrize(
    "make, spec_args, message",
    [
        (None, ("missing.txt",), "no such file or folder"),
        (lambda p: p.write_bytes(b""), ("f.txt",), "the file is empty"),
        (lambda p: p.mkdir(), ("f.txt",), "holds no non-empty files"),
        (lambda p: p.write_bytes(b"\x01\x00\x02"), ("f.bin", 256), "not a whole number of uint16"),
        (lambda p: p.write_bytes(b""), ("f.bin", 256), "the file is empty"),
        (lambda p: p.write_bytes(b"\x01\x00"), ("f.bin",), "needs --vocab-size"),
        (lambda p: p.write_bytes(b"text"), ("f.txt", 300), "--vocab-size is for .bin"),
    ],
)
def test_bad_data_is_refused(tmp_path, make, spec_args, message):
    path = tmp_path / spec_args[0]
    if make is not None:
        make(path)
    with pytest.raises(DataError, match=message):
        open_stream(str(path), *spec_args[1:])


def test_folder_of_token_files_is_refused(tmp_path):
    _write_tokens(tmp_path / "train.bin", [1, 2, 3])
    with pytest.raises(DataError, match="pass one of them with --vocab-size"):
        open_stream(str(tmp_path))


def test_tokens_out_of_vocabulary(tmp_path):
    path = tmp_path / "t.bin"
    _write_tokens(path, [5] * 100 + [70] + [5] * 99)
    data = Dataset(open_stream(str(path), vocab_size=64), val_fraction=0.0)
    with pytest.raises(DataError, match=r"token 70 \(.*t.bin at token 100\) is out of --vocab"):
        for step in range(50):
            data.train_batch(step, 0, batch=4, seq_len=31)


def test_uint32_token_files_for_vocabularies_above_65536(tmp_path):
    """Llama 3's 128256 tokens: a .bin file of uint32 tokens, read back exactly (ids above
    65535 included), checked against the vocabulary; uint16 stays the layout up to 65536
    (benchmarks/memory_plan.py's Llama presets were refused before)."""
    path = tmp_path / "llama.bin"
    ids = torch.tensor([0, 65535, 65536, 128255, 7, 100000] * 20)
    ids.to(torch.uint32).numpy().tofile(path)
    stream = open_stream(str(path), vocab_size=128256)
    assert stream.dtype == torch.uint32 and stream.info["token_dtype"] == "uint32"
    assert_bitwise_equal(stream.read(0, len(ids)), ids)
    assert open_stream(str(path), vocab_size=1 << 16).dtype == torch.uint16
    data = Dataset(open_stream(str(path), vocab_size=100000), val_fraction=0.0)
    with pytest.raises(DataError, match=r"token 128255 .* is out of --vocab-size 100000"):
        data.train_batch(0, 0, batch=4, seq_len=29)
    (tmp_path / "short.bin").write_bytes(b"\x01\x00\x00\x00\x02\x00")
    with pytest.raises(DataError, match="not a whole number of uint32 tokens"):
        open_stream(str(tmp_path / "short.bin"), vocab_size=128256)
    with pytest.raises(DataError, match="below 2\\*\\*32"):
        open_stream(str(path), vocab_size=(1 << 32) + 1)


def test_sequences_longer_than_the_data(text):
    data = Dataset(open_stream(str(text)), val_fraction=0.01)  # 60 validation tokens
    data.check_seq_len(48)
    with pytest.raises(DataError, match="validation part .* holds 60"):
        data.check_seq_len(64)
    with pytest.raises(DataError, match="training part .* holds 6000"):
        Dataset(open_stream(str(text)), val_fraction=0.0).check_seq_len(6000)
