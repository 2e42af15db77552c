"""`powerinfer show`: what a model file holds, checked against the gguf package reading the same file."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from powerinfer.convert.model import gguf_source, write_model
from powerinfer.gguf import open_gguf
from powerinfer.gguf.file_type import file_type_label
from powerinfer.sparse.predictor_training import PredictorDirectory

from helpers import assert_one_line_error, place_everything, powerinfer


def field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def test_show_json_agrees_with_the_gguf_package(default_model):
    result = powerinfer("show", str(default_model), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    reader = GGUFReader(default_model)
    arch = field(reader, "general.architecture")
    model = info["model"]
    assert (model["architecture"], model["context_length"], model["layers"], model["embedding_length"]) == \
        (arch, field(reader, f"{arch}.context_length"), field(reader, f"{arch}.block_count"),
         field(reader, f"{arch}.embedding_length"))
    assert model["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    assert Counter({e["type"]: e["tensors"] for e in info["quantization_mix"]}) == \
        Counter(t.tensor_type.name for t in reader.tensors)
    assert sum(e["bytes"] for e in info["quantization_mix"]) == sum(int(t.n_bytes) for t in reader.tensors)
    assert info["tokenizer"]["tokens"] == len(field(reader, "tokenizer.ggml.tokens"))
    assert info["tokenizer"]["model"] == field(reader, "tokenizer.ggml.model")
    assert info["chat_template"]["template"] == field(reader, "tokenizer.chat_template")
    assert info["sparsity"]["predictors"] is None and info["sparsity"]["gpu_index"] is None


def test_show_text(default_model):
    result = powerinfer("show", str(default_model))
    assert result.returncode == 0, result.stderr
    for line in ("architecture            llama", "context length          8192", "model                   gpt2",
                 "from                    the model file", "predictors              none"):
        assert line in result.stdout


@pytest.mark.parametrize("code, label", [(0, "all F32"), (1, "F16"), (2, "Q4_0"), (7, "Q8_0"), (10, "Q2_K - Medium"),
                                         (12, "Q3_K - Medium"), (15, "Q4_K - Medium"), (16, "Q5_K - Small"),
                                         (18, "Q6_K"), (32, "BF16")])
def test_file_type_labels_are_llama_cpps(default_model, tmp_path, code, label):
    """llama.cpp's llama_model_ftype_name spellings, from general.file_type rather than the tensors."""
    from gguf import GGUFValueType

    source = gguf_source(default_model)
    source.typed_metadata["general.file_type"] = (code, GGUFValueType.UINT32, None)
    path = tmp_path / "labelled.gguf"
    write_model(source, path, progress=False)
    assert file_type_label(open_gguf(path)) == label


def test_show_a_sparse_file_with_its_gpu_index(tiny_relu, tmp_path):
    dense = tiny_relu("q4_0")
    source = gguf_source(dense)
    config = json.loads(powerinfer("show", str(dense), "--json").stdout)["model"]
    n_layers, n_embd, n_ff, rank = config["layers"], config["embedding_length"], config["feed_forward_length"], 16
    generator = torch.Generator().manual_seed(0)
    predictors = PredictorDirectory([torch.randn(rank, n_embd, generator=generator) for _ in range(n_layers)],
                                    [torch.randn(n_ff, rank, generator=generator) for _ in range(n_layers)],
                                    0.25, [0.25, 0.5], None)
    path = tmp_path / "model.powerinfer.gguf"
    write_model(source, path, predictors=predictors, progress=False)
    place_everything(path)
    info = json.loads(powerinfer("show", str(path), "--json").stdout)
    sparsity = info["sparsity"]
    assert sparsity["powerinfer_file"] and sparsity["predictors"] == {"ffn_units": n_layers, "ranks": [rank]}
    assert sparsity["predictor_thresholds"] == pytest.approx([0.25, 0.5])
    assert sparsity["gpu_index"]["neurons_on_accelerator"] == n_layers * n_ff
    # the predictors are not the model's parameters
    assert info["model"]["parameters"] == sum(int(np.prod(t.shape)) for t in open_gguf(dense).tensors.values())
    text = powerinfer("show", str(path)).stdout
    assert f"{n_layers} FFNs, ranks {rank}" in text and "model.powerinfer.gguf.generated.gpuidx" in text


def test_show_a_missing_file(tmp_path):
    assert_one_line_error(powerinfer("show", str(tmp_path / "none.gguf")), "no such file")


def test_run_prints_a_model_summary_at_load(default_model):
    result = powerinfer("run", "-m", str(default_model), "-p", "Hi", "-n", "1", "-c", "256", "-t", "1")
    assert result.returncode == 0, result.stderr
    reader = GGUFReader(default_model)
    parameters = sum(int(t.n_elements) for t in reader.tensors) / 1e6
    summary = [line for line in result.stderr.splitlines() if line.startswith("powerinfer: ")]
    assert len(summary) == 1, result.stderr
    assert summary[0].startswith(f"powerinfer: {field(reader, 'general.name')}: llama, {parameters:.2f} M parameters, "
                                 f"Q4_1, ")
    assert "context 256 (trained 8192), 1 threads, sparsity off" in summary[0]


def test_run_reports_the_ffn_work_it_skipped(tiny_relu):
    """A ReLU model under --sparsity oracle skips the neurons that are exactly zero; dense says nothing."""
    import re

    path = tiny_relu("q4_0")
    result = powerinfer("run", "-m", str(path), "-p", "Once upon a time", "-n", "6", "--temp", "0",
                        "--sparsity", "oracle")
    assert result.returncode == 0, result.stderr
    skipped = re.search(r"sparsity\s+=\s+([\d.]+)% of FFN neurons skipped per token", result.stderr)
    assert skipped is not None and 0 < float(skipped[1]) < 100, result.stderr
    dense = powerinfer("run", "-m", str(path), "-p", "Once upon a time", "-n", "6", "--temp", "0", "--sparsity", "off")
    assert dense.returncode == 0 and "FFN neurons skipped" not in dense.stderr
