"""Reading and writing GGUF / PowerInfer GGUF, and every way a file can be broken."""

from __future__ import annotations

import os
import resource
import struct
import subprocess
import sys
import tracemalloc
from datetime import timedelta

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer.errors import ModelFileError, PowerInferError, UnsupportedModelError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.models import check_tensor_types, read_config

from helpers import assert_one_line_error, powerinfer


def small_file(path, powerinfer=False, ggml_type=T.Q4_0):
    weights = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 100
    data = quants.quantize(weights, ggml_type) if ggml_type not in (T.F32,) else weights
    write_gguf(path, "llama", {"general.name": "small", "llama.block_count": 1, "some.list": [1, 2, 3]},
               [TensorData("w.weight", data, ggml_type), TensorData("n.weight", np.ones(32, np.float32), T.F32)],
               powerinfer=powerinfer)
    return weights


@pytest.mark.parametrize("powerinfer", [False, True])
def test_round_trip(tmp_path, powerinfer):
    path = tmp_path / "m.gguf"
    weights = small_file(path, powerinfer)
    assert path.read_bytes()[:4] == (b"PWRI" if powerinfer else b"GGUF")
    f = open_gguf(path)
    assert f.is_powerinfer == powerinfer
    assert f.get("general.name") == "small" and f.get("llama.block_count") == 1 and f.get("some.list") == [1, 2, 3]
    w = f.tensor("w.weight")
    assert w.ggml_type == T.Q4_0 and w.shape == (64, 32)
    np.testing.assert_array_equal(quants.dequantize(w.data, T.Q4_0), quants.dequantize(quants.quantize(weights, T.Q4_0), T.Q4_0))


def test_reads_files_written_by_gguf_writer_like_gguf_reader(tmp_path):
    path = tmp_path / "m.gguf"
    small_file(path)
    theirs = GGUFReader(path)
    ours = open_gguf(path)
    assert {t.name for t in theirs.tensors} == set(ours.tensors)
    for t in theirs.tensors:
        np.testing.assert_array_equal(np.asarray(t.data), ours.tensor(t.name).data)


def test_default_model_metadata_matches_gguf_reader(default_model):
    theirs = GGUFReader(default_model)
    ours = open_gguf(default_model)
    for key in ("llama.block_count", "llama.embedding_length", "tokenizer.ggml.model", "general.architecture"):
        assert ours.get(key) == theirs.fields[key].contents()
    assert len(ours.tensors) == len(theirs.tensors)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        open_gguf(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_text("hello world, not a model")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        open_gguf(path)


def test_directory(tmp_path):
    with pytest.raises(ModelFileError, match="directory"):
        open_gguf(tmp_path)


@pytest.mark.parametrize("keep", [6, 100, -40])
def test_truncated(tmp_path, keep):
    path = tmp_path / "m.gguf"
    small_file(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(ModelFileError, match="truncated|corrupt"):
        open_gguf(path)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", {}, [TensorData("w.weight", np.zeros((4, 66), np.uint8), T.TQ2_0)])
    with pytest.raises(UnsupportedModelError, match="unsupported tensor type TQ2_0"):
        check_tensor_types(open_gguf(path))


# -- hostile headers ----------------------------------------------------------------------------

class RawGGUF:
    """GGUF bytes built by hand (independently of our reader and of the gguf writer), remembering
    where each count, length, type code and offset sits so that tests can corrupt exactly those."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.fields: list[tuple[str, int, str]] = []  # (what, position, struct format) of each header number

    def number(self, fmt: str, value: int | float, what: str | None = "number") -> None:
        if what is not None:
            self.fields.append((what, len(self.data), fmt))
        self.data += struct.pack("<" + fmt, value)

    def string(self, text: str, what: str = "string length") -> None:
        raw = text.encode()
        self.number("Q", len(raw), what)
        self.data += raw

    def key(self, name: str, value_type: GGUFValueType) -> None:
        self.string(name, "key length")
        self.number("I", value_type, "value type")

    def corrupted(self, changes: list[tuple[int | str, int]]) -> bytes:
        """The bytes with header numbers replaced: by index among all of them, or the first of a kind."""
        data = bytearray(self.data)
        for field, value in changes:
            if isinstance(field, str):
                _, position, fmt = next(f for f in self.fields if f[0] == field)
            else:
                _, position, fmt = self.fields[field % len(self.fields)]
            size = struct.calcsize(fmt)
            data[position : position + size] = (value % 2 ** (8 * size)).to_bytes(size, "little")
        return bytes(data)


def raw_small_file() -> RawGGUF:
    """magic, version, 2 tensors, 4 keys (a string, the alignment, a string array, an i32 array),
    then a Q4_0 [4, 32] and an F32 [8] tensor."""
    raw = RawGGUF()
    raw.data += b"GGUF"
    raw.number("I", 3, "version")
    raw.number("Q", 2, "n_tensors")
    raw.number("Q", 4, "n_kv")
    raw.key("general.architecture", GGUFValueType.STRING)
    raw.string("llama")
    raw.key("general.alignment", GGUFValueType.UINT32)
    raw.number("I", 32, "alignment")
    raw.key("tokens", GGUFValueType.ARRAY)
    raw.number("I", GGUFValueType.STRING, "item type")
    raw.number("Q", 3, "array count")
    for token in ("a", "bc", "def"):
        raw.string(token, "token length")
    raw.key("numbers", GGUFValueType.ARRAY)
    raw.number("I", GGUFValueType.INT32, "item type")
    raw.number("Q", 3, "array count")
    for n in (1, 2, 3):
        raw.number("i", n, None)
    q4 = quants.quantize(np.linspace(-1, 1, 128, dtype=np.float32).reshape(4, 32), T.Q4_0)
    for name, dims, ggml_type, offset in (("w.weight", (32, 4), T.Q4_0, 0), ("n.weight", (8,), T.F32, 96)):
        raw.string(name, "tensor name length")
        raw.number("I", len(dims), "n_dims")
        for d in dims:
            raw.number("Q", d, "dim")
        raw.number("I", ggml_type, "tensor type")
        raw.number("Q", offset, "tensor offset")
    raw.data += bytes(-len(raw.data) % 32)
    raw.data += q4.tobytes() + bytes(96 - q4.nbytes) + np.arange(8, dtype=np.float32).tobytes()
    return raw


def test_hand_built_file_reads_as_built(tmp_path):
    path = tmp_path / "raw.gguf"
    path.write_bytes(raw_small_file().data)
    f = open_gguf(path)
    assert f.get("tokens") == ["a", "bc", "def"] and f.get("numbers") == [1, 2, 3]
    assert f.tensor("w.weight").shape == (4, 32) and f.tensor("w.weight").ggml_type == T.Q4_0
    np.testing.assert_array_equal(f.tensor("n.weight").data, np.arange(8, dtype=np.float32))
    theirs = GGUFReader(path)  # the reference reader agrees on this well-formed file
    assert theirs.fields["tokens"].contents() == f.get("tokens")


def forty_nine_byte_bomb() -> bytes:
    """One metadata array declaring 2**40 strings, in 49 bytes (issue 16)."""
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
    data += struct.pack("<IIQ", GGUFValueType.ARRAY, GGUFValueType.STRING, 2**40)
    assert len(data) == 49
    return data


def test_array_bomb_fails_at_once_without_allocating(tmp_path):
    path = tmp_path / "bomb.gguf"
    path.write_bytes(forty_nine_byte_bomb())
    tracemalloc.start()
    try:
        with pytest.raises(ModelFileError, match="cannot fit"):
            open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("field, value, message", [
    ("n_tensors", 2**60, "cannot fit"),
    ("n_kv", 2**64 - 1, "cannot fit"),
    ("key length", 2**63, "cannot fit"),
    ("value type", 99, "unknown value type 99"),
    ("alignment", 3, "not a power of two"),
    ("alignment", 0, "not a power of two"),
    ("item type", 13, "unknown value type 13"),
    ("array count", 2**40, "cannot fit"),
    ("token length", 2**33, "runs past the end"),
    ("tensor name length", 2**64 - 1, "cannot fit"),
    ("n_dims", 0, "0 dimensions"),
    ("n_dims", 7, "7 dimensions"),
    ("dim", 33, "not whole Q4_0 blocks"),
    ("dim", 2**40, "runs past the end"),
    ("tensor type", 4, "unknown type code 4"),
    ("tensor type", 2**31, "unknown type code"),
    ("tensor offset", 2**63, "runs past the end"),
    ("tensor offset", 8, "not a multiple of the alignment"),
])
def test_corrupt_header_numbers(tmp_path, field, value, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw_small_file().corrupted([(field, value)]))
    with pytest.raises(ModelFileError, match=message) as error:
        open_gguf(path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("version", [1, 4, 2**24])
def test_unsupported_version(tmp_path, version):
    path = tmp_path / "v.gguf"
    path.write_bytes(raw_small_file().corrupted([("version", version)]))
    with pytest.raises(ModelFileError, match=f"unsupported GGUF version {version}"):
        open_gguf(path)


def test_fifo_is_refused_without_blocking(tmp_path):
    path = tmp_path / "model.gguf"
    os.mkfifo(path)
    with pytest.raises(ModelFileError, match="not a regular file"):
        open_gguf(path)  # a blocking open() would wait here forever for a writer


HEADER_NUMBERS = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 8, 9, 12, 31, 32, 2**31, 2**32 - 1, 2**32, 2**40, 2**63,
                                            2**64 - 1]), st.integers(0, 2**64 - 1))


@settings(max_examples=300, deadline=timedelta(seconds=5))  # the deadline only catches hangs
@given(changes=st.lists(st.tuples(st.integers(0, 100), HEADER_NUMBERS), min_size=1, max_size=4),
       keep=st.one_of(st.none(), st.integers(0, 400)),
       flips=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 255)), max_size=3))
def test_fuzzed_headers_fail_cleanly_in_bounded_memory(tmp_path_factory, changes, keep, flips):
    """Header counts, lengths, types and offsets mutated, bytes flipped, the file cut: either it
    reads, or it is refused with one PowerInferError line; never another exception, never more
    than a few MB of memory for a file of a few hundred bytes."""
    data = bytearray(raw_small_file().corrupted(changes)[:keep])
    for position, mask in flips:
        if position < len(data):
            data[position] ^= mask
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    path.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        f = open_gguf(path)
        read_config(f)  # metadata of the wrong types or values must be refused the same way
    except PowerInferError as error:
        assert "\n" not in str(error)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 8 << 20


@pytest.mark.parametrize("dims", [(0, 2**63), (2**63, 0), (2**32, 2**32)])
def test_element_counts_past_64_bits_are_refused(tmp_path, dims):
    """Dimensions whose product (zeros aside) passes int64, as llama.cpp refuses them: one line. (A 0
    beside 2**63 made the data empty and numpy's shape the traceback: hypothesis found it.)"""
    raw = raw_small_file()
    first, second = [i for i, f in enumerate(raw.fields) if f[0] == "dim"][:2]  # the Q4_0 tensor's
    path = tmp_path / "m.gguf"
    path.write_bytes(raw.corrupted([(first, dims[0]), (second, dims[1])]))
    with pytest.raises(ModelFileError, match="64-bit") as error:
        open_gguf(path)
    assert "\n" not in str(error.value)


def limited_memory(limit: int = 2 << 30):
    """A preexec_fn capping the child's address space (torch needs ~1 GB of it to import)."""
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.parametrize("padding", [0, 4 << 20])
def test_array_bomb_on_the_command_line_under_a_memory_cap(tmp_path, padding):
    """The 49-byte file, and a 4 MB variant whose zeros read as empty strings, exit 2 with one line
    in a process that could not grow past 2 GB."""
    path = tmp_path / "bomb.gguf"
    path.write_bytes(forty_nine_byte_bomb() + bytes(padding))
    result = subprocess.run([sys.executable, "-m", "powerinfer.cli", "run", "-m", str(path), "-p", "hi"],
                            capture_output=True, text=True, timeout=120, preexec_fn=limited_memory())
    assert_one_line_error(result, str(path), "cannot fit")


def test_array_bomb_through_the_api(tmp_path):
    from powerinfer import LLM

    path = tmp_path / "bomb.gguf"
    path.write_bytes(forty_nine_byte_bomb())
    with pytest.raises(PowerInferError, match="cannot fit"):
        LLM(path)


def test_fifo_on_the_command_line(tmp_path):
    path = tmp_path / "model.gguf"
    os.mkfifo(path)
    assert_one_line_error(powerinfer("run", "-m", str(path), "-p", "hi", timeout=120), "not a regular file")
