"""`powerinfer quantize`: K-quant mixes per llama.cpp's recipe, re-quantizing only when asked, and
PowerInfer GGUF kept PowerInfer GGUF. Files are read back with the `gguf` package."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, quants

from powerinfer import cli
from powerinfer.convert.encode import parse_outtype
from powerinfer.convert.hf import convert_hf
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.gguf import open_gguf
from powerinfer.sparse.predictor import SPARSE_THRESHOLD_KEY
from powerinfer.sparse.predictor_training import PredictorDirectory

from conftest import make_tiny_llama
from helpers import assert_one_line_error, powerinfer

N_LAYERS = 8
# llama.cpp's "more bits" layers for 8 layers: the first and last eighth (0, 7) and every third
# layer from the first eighth on (3, 6).
MORE_BITS = {0, 3, 6, 7}
# Relative RMS error a type may leave on Gaussian-like weights (its rounding step over √12, with room).
RELATIVE_RMS = {T.F32: 1e-6, T.F16: 1e-3, T.Q8_0: 0.01, T.Q6_K: 0.03, T.Q5_0: 0.07, T.Q5_1: 0.07, T.Q5_K: 0.05,
                T.Q4_0: 0.12, T.Q4_K: 0.1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama whose rows are whole K-quant super-blocks (256 wide) except ffn_down's (640
    values: 2.5 super-blocks), converted to F16 by our converter: {"tied": ..., "untied": ...}."""
    sources = {}
    for tied in (False, True):
        folder = tmp_path_factory.mktemp("tied" if tied else "untied")
        make_tiny_llama(folder, "relu", overrides=dict(vocab_size=512, hidden_size=256, intermediate_size=640,
                                                       num_hidden_layers=N_LAYERS, tie_word_embeddings=tied,
                                                       initializer_range=0.02))
        sources["tied" if tied else "untied"] = folder / "model-f16.gguf"
        convert_hf(folder, sources["tied" if tied else "untied"], parse_outtype("f16"), progress=False)
    return sources


def llama_cpp_q4_k_m(name: str, tied: bool = False) -> T:
    """llama.cpp's Q4_K_M choice for this model, written out from its rules (see mixes.py)."""
    layer = int(name.split(".")[1]) if name.startswith("blk.") else None
    if name.endswith("norm.weight"):
        return T.F32
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K
    if ".ffn_down." in name:  # 640 wide: Q6_K falls back to Q8_0, Q4_K to Q5_0
        return T.Q8_0 if layer in MORE_BITS else T.Q5_0
    if ".attn_v." in name and layer in MORE_BITS:
        return T.Q6_K
    return T.Q4_K


def quantize(source, target, kind: str, *flags: str) -> GGUFReader | None:
    """`powerinfer quantize` (in this process; the error tests run the real command), and the
    `gguf` package's reading of a GGUF result (None for PWRI)."""
    assert cli.main(["quantize", str(source), str(target), kind, *flags]) == 0
    return None if open_gguf(target).is_powerinfer else GGUFReader(target)


def assert_close_to_source(reader: GGUFReader, source: GGUFReader) -> None:
    originals = {t.name: t for t in source.tensors}
    for tensor in reader.tensors:
        original = originals[tensor.name]
        expected = quants.dequantize(original.data, original.tensor_type).reshape(-1)
        actual = quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        error = np.sqrt(np.mean((actual - expected) ** 2)) / np.sqrt(np.mean(expected**2))
        assert error < RELATIVE_RMS[tensor.tensor_type], (tensor.name, tensor.tensor_type.name, error)


@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_q4_k_m_follows_llama_cpp_recipe(tiny, tmp_path, tied):
    reader = quantize(tiny[tied], tmp_path / "q4_k_m.gguf", "Q4_K_M")
    names = {t.name for t in reader.tensors}
    assert ("output.weight" in names) == (tied == "untied")
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types == {name: llama_cpp_q4_k_m(name, tied == "tied") for name in names}
    assert reader.fields["general.file_type"].contents() == 15  # llama.cpp's MOSTLY_Q4_K_M
    assert_close_to_source(reader, GGUFReader(tiny[tied]))


def test_q5_k_m_and_pure_types(tiny, tmp_path):
    q5 = {t.name: t.tensor_type for t in quantize(tiny["untied"], tmp_path / "q5_k_m.gguf", "q5_k_m").tensors}
    assert {q5[f"blk.{i}.attn_v.weight"] for i in MORE_BITS} == {T.Q6_K}
    assert q5["blk.1.attn_v.weight"] == q5["blk.1.attn_q.weight"] == T.Q5_K
    assert q5["blk.1.ffn_down.weight"] == T.Q5_1 and q5["blk.0.ffn_down.weight"] == T.Q8_0  # 640 wide
    for kind, ggml_type in (("Q6_K", T.Q6_K), ("Q4_K", T.Q4_K)):
        reader = quantize(tiny["untied"], tmp_path / f"{kind}.gguf", kind)
        types = {t.name: t.tensor_type for t in reader.tensors if len(t.shape) > 1}
        down = {types.pop(f"blk.{i}.ffn_down.weight") for i in range(N_LAYERS)}  # 640 wide: the fallback
        assert down == {T.Q8_0 if ggml_type == T.Q6_K else T.Q5_0} and set(types.values()) == {ggml_type}
        assert_close_to_source(reader, GGUFReader(tiny["untied"]))


def test_requantizing_needs_the_flag(tiny, tmp_path):
    q4_0 = tmp_path / "q4_0.gguf"
    quantize(tiny["untied"], q4_0, "Q4_0")
    target = tmp_path / "again.gguf"
    assert_one_line_error(powerinfer("quantize", str(q4_0), str(target), "Q4_K_M"), "already quantized", "Q4_0",
                          "--allow-requantize")
    assert not target.exists()
    reader = quantize(q4_0, target, "Q4_K_M", "--allow-requantize")
    assert {t.name: t.tensor_type for t in reader.tensors} == {t.name: llama_cpp_q4_k_m(t.name) for t in reader.tensors}
    assert_close_to_source(reader, GGUFReader(q4_0))


def test_default_model_needs_the_flag(default_model, tmp_path):
    target = tmp_path / "smollm2.gguf"
    assert_one_line_error(powerinfer("quantize", str(default_model), str(target), "Q4_K_M"), "already quantized", "Q4_1")
    assert not target.exists()


@pytest.fixture(scope="module")
def powerinfer_gguf(tiny, tmp_path_factory):
    """The untied tiny llama as PowerInfer GGUF (F16), with random rank-32 predictors."""
    generator = torch.Generator().manual_seed(0)
    predictors = PredictorDirectory(
        fc1=[torch.randn(32, 256, generator=generator) * 0.05 for _ in range(N_LAYERS)],
        fc2=[torch.randn(640, 32, generator=generator) * 0.05 for _ in range(N_LAYERS)],
        sparse_threshold=0.5, layer_thresholds=None, activation_thresholds=None)
    path = tmp_path_factory.mktemp("pwri") / "model.powerinfer.gguf"
    write_model(gguf_source(tiny["untied"]), path, None, predictors, progress=False)
    return path


def test_powerinfer_preset_as_powerinfers_quantize(powerinfer_gguf, tmp_path):
    target = tmp_path / "model.powerinfer.q4_0.gguf"
    quantize(powerinfer_gguf, target, "POWERINFER_Q4_0")
    ours, source = open_gguf(target), open_gguf(powerinfer_gguf)
    assert ours.is_powerinfer and ours.get(SPARSE_THRESHOLD_KEY) == source.get(SPARSE_THRESHOLD_KEY)
    types = {name: t.ggml_type for name, t in ours.tensors.items() if len(t.shape) > 1}
    assert types.pop("output.weight") == T.Q6_K
    assert set(types.values()) == {T.Q4_0}  # ffn_down_t, the predictors and the rest
    for name in ("blk.1.fc1.weight", "blk.1.fc2.weight", "blk.1.ffn_down_t.weight"):
        expected = source.tensors[name].data.astype(np.float32)
        decoded = quants.dequantize(ours.tensors[name].rows_as_bytes(), T.Q4_0)
        assert np.sqrt(np.mean((decoded - expected) ** 2)) < RELATIVE_RMS[T.Q4_0] * np.sqrt(np.mean(expected**2))


def test_q4_k_m_keeps_powerinfer_layout(powerinfer_gguf, tmp_path):
    target = tmp_path / "model.powerinfer.q4_k_m.gguf"
    quantize(powerinfer_gguf, target, "Q4_K_M")
    ours, source = open_gguf(target), open_gguf(powerinfer_gguf)
    assert ours.is_powerinfer and "blk.0.ffn_down.weight" not in ours.tensors
    for layer in range(N_LAYERS):
        down_t = ours.tensors[f"blk.{layer}.ffn_down_t.weight"]
        # ffn_down_t follows ffn_down's rule, quantized along its own rows (one neuron each, 256 wide).
        assert down_t.ggml_type == (T.Q6_K if layer in MORE_BITS else T.Q4_K) and down_t.shape == (640, 256)
        expected = source.tensors[f"blk.{layer}.ffn_down_t.weight"].data.astype(np.float32)
        rows = quants.dequantize(down_t.rows_as_bytes(), down_t.ggml_type)
        assert np.sqrt(np.mean((rows - expected) ** 2)) < RELATIVE_RMS[down_t.ggml_type] * np.sqrt(np.mean(expected**2))
        for predictor in ("fc1", "fc2"):  # kept as they are outside the PowerInfer preset
            np.testing.assert_array_equal(ours.tensors[f"blk.{layer}.{predictor}.weight"].data,
                                          source.tensors[f"blk.{layer}.{predictor}.weight"].data)
