"""Reading and writing GGUF / PowerInfer GGUF, and every way a file can be broken."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.models import check_tensor_types


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
