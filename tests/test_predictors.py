"""Predictor training, PowerInfer GGUF conversion and quantization, on tiny random llama models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from powerinfer.config import ACTIVATION_KEY, FFNActivation
from powerinfer.convert.encode import parse_outtype
from powerinfer.convert.hf import hf_source
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.gguf import open_gguf
from powerinfer.models import read_config
from powerinfer.sparse.ffn import SparseFFN
from powerinfer.sparse.predictor import MIN_GATED_PREDICTED_SPARSITY, PREDICTED_SPARSITY_KEY, SPARSE_THRESHOLD_KEY
from powerinfer.sparse.predictor_training import (
    TrainedPredictor,
    TrainingOptions,
    load_predictors,
    save_predictors,
    train_predictors,
)
from powerinfer.sparse.profiler import calibration_chunks, firing_thresholds

from helpers import assert_one_line_error, decode_logits, engine, powerinfer, read_back_powerinfer_gguf

OPTIONS = TrainingOptions(ranks=(32, 128), steps=300)
TOKENS, CHUNK = 4096, 256


def _train(gguf_path: Path, text: str, out: Path, target_sparsity: float | None = None):
    from powerinfer import LLM

    llm = LLM(gguf_path, n_ctx=CHUNK, sparsity="off")
    ids = llm.tokenize(text, add_bos=False)
    thresholds, _ = firing_thresholds(llm.model, calibration_chunks(ids, TOKENS, CHUNK), target_sparsity)
    predictors, reports = train_predictors(llm.model, ids, thresholds, TOKENS, CHUNK, OPTIONS)
    save_predictors(out, predictors, reports, None if llm.config.activation.is_relu_family else thresholds)
    return reports


@pytest.fixture(scope="module")
def ids(tiny_llama, wikitext_valid) -> list[int]:
    """Wikitext tokens far from the training part (predictors are fitted to text like it)."""
    from powerinfer.tokenizer import Tokenizer

    _, _, ggufs = tiny_llama
    return Tokenizer.from_gguf(open_gguf(ggufs["f32"])).encode(wikitext_valid[-20000:], add_bos=False)[:30]


@pytest.fixture(scope="module")
def trained(tiny_llama, wikitext_valid, tmp_path_factory):
    """(hf model, folder, ggufs, predictor dir, held-out reports) for each tiny llama."""
    hf_model, folder, ggufs = tiny_llama
    out = tmp_path_factory.mktemp("predictors") / "pred"
    silu = hf_model.config.hidden_act == "silu"
    reports = _train(ggufs["q4_0"], wikitext_valid, out, target_sparsity=0.5 if silu else None)
    return hf_model, folder, ggufs, out, reports


def test_predictors_reach_the_recall_target_on_held_out_text(trained):
    hf_model, _, _, out, reports = trained
    for r in reports:
        assert r.recall >= 0.99, r
        assert 0.0 < r.true_sparsity < 1.0
        assert r.rank in OPTIONS.ranks
    if hf_model.config.hidden_act == "relu":  # ReLU firing is predictable: most of the sparsity is kept
        assert all(r.predicted_sparsity > 0.6 * r.true_sparsity for r in reports), reports


def test_predictor_directory_has_powerinfers_layout(trained):
    hf_model, _, _, out, reports = trained
    c = hf_model.config
    for i, r in enumerate(reports):
        state = torch.load(out / f"model_{i}.pt", weights_only=True)
        assert set(state) == {"fc1.weight", "fc2.weight"}
        assert state["fc1.weight"].shape == (r.rank, c.hidden_size)
        assert state["fc2.weight"].shape == (c.intermediate_size, r.rank)
    loaded = load_predictors(out)
    assert loaded.sparse_threshold == min(loaded.layer_thresholds)
    assert (loaded.activation_thresholds is None) == (c.hidden_act == "relu")


def test_powerinfer_gguf_from_hugging_face_holds_predictors_and_transposed_down(trained, tmp_path):
    hf_model, folder, _, out, _ = trained
    path = tmp_path / "model.powerinfer.gguf"
    write_model(hf_source(folder), path, parse_outtype("f32"), load_predictors(out), progress=False)
    reader = read_back_powerinfer_gguf(path, tmp_path)
    tensors = {t.name: t for t in reader.tensors}
    predictors = load_predictors(out)
    for i, layer in enumerate(hf_model.model.layers):
        assert f"blk.{i}.ffn_down.weight" not in tensors
        down_t = np.asarray(tensors[f"blk.{i}.ffn_down_t.weight"].data)
        np.testing.assert_array_equal(down_t, layer.mlp.down_proj.weight.detach().numpy().T)
        fc1 = np.asarray(tensors[f"blk.{i}.fc1.weight"].data)
        np.testing.assert_array_equal(fc1, predictors.fc1[i].numpy().astype(np.float16))
        assert tuple(tensors[f"blk.{i}.fc2.weight"].shape) == (predictors.fc1[i].shape[0], hf_model.config.intermediate_size)
    assert reader.fields[SPARSE_THRESHOLD_KEY].types == [GGUFValueType.FLOAT32]
    assert reader.fields[SPARSE_THRESHOLD_KEY].contents() == pytest.approx(predictors.sparse_threshold)


def test_powerinfer_gguf_round_trips(trained, tmp_path):
    _, folder, ggufs, out, _ = trained
    first = tmp_path / "first.gguf"
    second = tmp_path / "second.gguf"
    write_model(gguf_source(ggufs["q4_0"]), first, None, load_predictors(out), progress=False)
    write_model(gguf_source(first), second, None, progress=False)  # rewritten as it is
    a, b = read_back_powerinfer_gguf(first, tmp_path), read_back_powerinfer_gguf(second, tmp_path)
    assert {k: f.contents() for k, f in a.fields.items()} == {k: f.contents() for k, f in b.fields.items()}
    assert {k: f.types for k, f in a.fields.items()} == {k: f.types for k, f in b.fields.items()}
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert (x.name, x.tensor_type) == (y.name, y.tensor_type)
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data))


def test_powerinfer_gguf_from_a_gguf_keeps_its_activation(trained, tmp_path, ids):
    """A llama GGUF without the activation key (llama.cpp's files) is SiLU-gated; written as a
    PowerInfer GGUF, which alone would read as ReLU-Llama, it must stay what it was."""
    _, _, ggufs, out, _ = trained
    source = gguf_source(ggufs["q4_0"])
    source.typed_metadata.pop(ACTIVATION_KEY)
    plain, pwri = tmp_path / "plain.gguf", tmp_path / "model.powerinfer.gguf"
    write_model(source, plain, None, progress=False)
    assert open_gguf(plain).get(ACTIVATION_KEY) is None
    write_model(gguf_source(plain), pwri, None, load_predictors(out), progress=False)
    assert read_config(open_gguf(plain)).activation == FFNActivation.SILU_GATED
    assert read_config(open_gguf(pwri)).activation == FFNActivation.SILU_GATED
    dense = decode_logits(engine(plain, sparsity="off"), ids)
    records = decode_logits(engine(pwri, sparsity="off"), ids)  # neuron records: down re-encoded as Q8_0
    assert (records - dense).norm() / dense.norm() < 0.1  # a wrong activation gives ~1


def test_sparse_modes_on_powerinfer_gguf(trained, tmp_path, ids):
    hf_model, folder, ggufs, out, _ = trained
    path = tmp_path / "f32.powerinfer.gguf"
    write_model(hf_source(folder), path, parse_outtype("f32"), load_predictors(out), progress=False)
    dense = decode_logits(engine(ggufs["f32"], sparsity="off"), ids)
    torch.testing.assert_close(decode_logits(engine(path, sparsity="off"), ids), dense, rtol=1e-4, atol=1e-4)
    auto_engine = engine(path, sparsity="auto")
    # ReLU: predictors everywhere; SiLU: where the file records that they rule out enough neurons
    relu = hf_model.config.hidden_act == "relu"
    pays = [relu or s >= MIN_GATED_PREDICTED_SPARSITY for s in open_gguf(path).get(PREDICTED_SPARSITY_KEY)]
    assert [isinstance(b.ffn, SparseFFN) and b.ffn.mode == "auto" for b in auto_engine.model.blocks] == pays
    auto = decode_logits(auto_engine, ids)
    # Each token, prompt tokens included, computes only the neurons predicted for it. Missed neurons
    # (1 % of those that fire) are near-zero for ReLU, up to the calibrated threshold's size for
    # SiLU: a larger error there.
    limit = 0.07 if hf_model.config.hidden_act == "relu" else 0.15
    assert (auto - dense).norm() / dense.norm() < limit
    # the same per-token choice whether rows come a few at a time (neuron kernels) or many (masked GEMMs)
    many_rows = auto_engine.all_logits(ids)[5:]
    torch.testing.assert_close(auto, many_rows, rtol=0, atol=1e-3 * many_rows.abs().max().item())
    if hf_model.config.hidden_act == "relu":
        assert all(b.ffn.last_active < b.ffn.store.n_ff for b in auto_engine.model.blocks)  # neurons were skipped
        oracle = decode_logits(engine(path, sparsity="oracle"), ids)
        torch.testing.assert_close(oracle, dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("predicted", [None, [0.05, 0.6]])
def test_auto_runs_a_gated_layer_dense_where_its_predictor_would_not_pay(trained, tmp_path, ids, predicted):
    """A SiLU layer whose predictor rules out few neurons (or a file that does not say) runs every
    neuron under "auto", with --sparsity off's exact result: auto is never slower than dense."""
    hf_model, _, ggufs, out, _ = trained
    if hf_model.config.hidden_act != "silu":
        pytest.skip("SiLU model only")
    directory = load_predictors(out)
    directory.predicted_sparsity = predicted
    path = tmp_path / "model.powerinfer.gguf"
    write_model(gguf_source(ggufs["q4_0"]), path, None, directory, progress=False)
    auto = engine(path, sparsity="auto")
    assert [b.ffn.mode for b in auto.model.blocks] == (["off", "off"] if predicted is None else ["off", "auto"])
    if predicted is None:
        torch.testing.assert_close(decode_logits(auto, ids), decode_logits(engine(path, sparsity="off"), ids),
                                   rtol=0, atol=0)


def test_quantize_keeps_predictors(trained, tmp_path, ids):
    _, _, ggufs, out, _ = trained
    pwri = tmp_path / "model.powerinfer.gguf"
    quantized = tmp_path / "model.powerinfer.q8_0.gguf"
    write_model(gguf_source(ggufs["f32"]), pwri, None, load_predictors(out), progress=False)
    result = powerinfer("quantize", str(pwri), str(quantized), "Q8_0")
    assert result.returncode == 0, result.stderr
    source, target = open_gguf(pwri), open_gguf(quantized)
    assert target.is_powerinfer
    assert target.tensors["blk.0.ffn_down_t.weight"].ggml_type.name == "Q8_0"
    np.testing.assert_array_equal(target.tensors["blk.1.fc2.weight"].data, source.tensors["blk.1.fc2.weight"].data)
    assert target.get(SPARSE_THRESHOLD_KEY) == source.get(SPARSE_THRESHOLD_KEY)
    dense = decode_logits(engine(pwri, sparsity="off"), ids)
    auto = decode_logits(engine(quantized, sparsity="auto"), ids)
    assert (auto - dense).norm() / dense.norm() < 0.15  # each token computes its own predicted neurons


def test_convert_rejects_predictors_of_another_model(trained, tmp_path):
    _, folder, ggufs, out, _ = trained
    wrong = tmp_path / "wrong"
    predictors = load_predictors(out)
    predictors.fc1[1] = torch.zeros(8, 32)  # d does not match
    save_predictors(wrong, [TrainedPredictor(a, b, 0.0) for a, b in zip(predictors.fc1, predictors.fc2)])
    target = tmp_path / "out.gguf"
    assert_one_line_error(powerinfer("convert", str(ggufs["q4_0"]), str(wrong), "--outfile", str(target)), "predictor 1")
    assert not target.exists() and not list(tmp_path.glob(".out.gguf*"))


def test_bad_inputs_to_the_sparsity_tools(trained, tmp_path):
    _, folder, ggufs, out, _ = trained
    short = tmp_path / "short.txt"
    short.write_text("too short to calibrate on")
    target = tmp_path / "pred"
    assert_one_line_error(powerinfer("train-predictors", "-m", str(ggufs["q4_0"]), "-f", str(short), "-o", str(target)),
                          "too short")
    assert not target.exists()
    assert_one_line_error(powerinfer("convert", str(ggufs["q4_0"]), str(tmp_path / "none"), "--outfile", str(target)),
                          "no model_*.pt")
    assert_one_line_error(powerinfer("quantize", str(ggufs["q4_0"]), str(target), "q2_k"), "unsupported quantization")
    bad_arch = tmp_path / "gpt2"
    bad_arch.mkdir()
    (bad_arch / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    assert_one_line_error(powerinfer("convert", str(bad_arch), "--outfile", str(target)), "unsupported architecture")


def test_quantized_predictors_stay_compact(tmp_path):
    """PowerInfer's quantizer writes fc1/fc2 as Q4_0: they stay in their blocks, on our kernels, and
    score as their exact weights do (to the kernel's bfloat16 rounding)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from powerinfer.gguf.writer import TensorData, write_gguf
    from powerinfer.ops.linear import DenseLinear
    from powerinfer.sparse.predictor import load_predictor

    rng = np.random.default_rng(0)
    weights = {"fc1": rng.standard_normal((64, 96)).astype(np.float32), "fc2": rng.standard_normal((128, 64)).astype(np.float32)}
    path = tmp_path / "p.gguf"
    write_gguf(path, "llama", {}, [TensorData(f"blk.0.{n}.weight", quants.quantize(w, T.Q4_0), T.Q4_0) for n, w in weights.items()])
    predictor = load_predictor(open_gguf(path), 0)
    bfloat16_bytes = (64 * 96 + 128 * 64) * 2
    assert not isinstance(predictor.fc1, DenseLinear) and predictor.nbytes < bfloat16_bytes / 2
    exact = {n: torch.from_numpy(quants.dequantize(quants.quantize(w, T.Q4_0), T.Q4_0)) for n, w in weights.items()}
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(0))
    expected = torch.relu(x @ exact["fc1"].T) @ exact["fc2"].T
    torch.testing.assert_close(predictor.scores(x), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
