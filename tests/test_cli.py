"""The command line: output on stdout, timings on stderr, and one-line errors with status 2."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
import torch

from powerinfer import LLM
from powerinfer.errors import PowerInferError
from powerinfer.gguf.writer import TensorData, write_gguf

from helpers import CAPITAL_QUESTION, assert_one_line_error, powerinfer


def test_run_prints_text_and_timings(default_model):
    result = powerinfer("run", "-m", str(default_model), "-p", "The capital of France is", "-n", "12", "--temp", "0")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "prompt eval time" in result.stderr and "tokens per second" in result.stderr


def test_run_greedy_equals_api(default_model, default_llm):
    result = powerinfer("run", "-m", str(default_model), "-p", "Once upon a time", "-n", "16", "--temp", "0")
    expected = default_llm.generate("Once upon a time", max_tokens=16, temperature=0)
    assert result.stdout.rstrip("\n") == expected


def test_chat_reads_stdin(default_model):
    result = powerinfer("chat", "-m", str(default_model), "--temp", "0", "-n", "24", stdin=CAPITAL_QUESTION + "\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only note")
def test_ngl_without_a_gpu_says_so_in_one_line(default_model, default_llm):
    result = powerinfer("run", "-m", str(default_model), "-p", "Once upon a time", "-n", "8", "--temp", "0", "-ngl", "99")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "-ngl" in line]
    assert notes == ["powerinfer: no CUDA device: -ngl 99 is ignored and everything runs on the CPU"]
    assert result.stdout.rstrip("\n") == default_llm.generate("Once upon a time", max_tokens=8, temperature=0)


def test_cache_type_reaches_the_engine(default_model):
    """-ctk f32 keeps the KV cache in float32, as LLM(cache_type="f32") does (the default is f16)."""
    llm = LLM(default_model, n_ctx=512, cache_type="f32")
    assert llm.engine.cache.keys[0].dtype == torch.float32
    result = powerinfer("run", "-m", str(default_model), "-c", "512", "-p", "Once upon a time", "-n", "16", "--temp", "0",
                        "-ctk", "f32")
    assert result.stdout.rstrip("\n") == llm.generate("Once upon a time", max_tokens=16, temperature=0)
    assert LLM(default_model, n_ctx=64).engine.cache.keys[0].dtype == torch.float16
    with pytest.raises(PowerInferError, match="unknown cache type 'q8_0'"):
        LLM(default_model, cache_type="q8_0")


def test_run_cnv_chats(default_model):
    result = powerinfer("run", "-cnv", "-m", str(default_model), "--temp", "0", "-n", "24",
                        stdin=CAPITAL_QUESTION + "\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_bench_prints_markdown_table_as_it_goes(default_model):
    result = powerinfer("bench", "-m", str(default_model), "-p", "16", "-n", "4", "-r", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("| model | size | params | backend | threads | sparsity | test | t/s")
    assert [line.split("|")[7].strip() for line in lines[2:]] == ["pp16", "tg4"]
    assert [line.split("|")[6].strip() for line in lines[2:]] == ["off", "off"]
    assert "bench pp16" in result.stderr and "bench tg4" in result.stderr  # the progress bar names each test


# llama-bench's JSON fields (tools/llama-bench/README.md) that describe a test and its timings.
LLAMA_BENCH_FIELDS = {"model_filename", "model_type", "model_size", "model_n_params", "n_threads", "n_gpu_layers",
                      "n_prompt", "n_gen", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts"}


def test_bench_json_and_csv_records_as_llama_bench_writes_them(default_model):
    flags = ["bench", "-m", str(default_model), "-p", "8,16", "-p", "0", "-n", "2", "-r", "3"]
    result = powerinfer(*flags, "-o", "json")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert [(r["n_prompt"], r["n_gen"]) for r in records] == [(8, 0), (16, 0), (0, 2)]
    for r in records:
        assert LLAMA_BENCH_FIELDS <= r.keys()
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 3
        tokens = r["n_prompt"] + r["n_gen"]
        np.testing.assert_allclose(r["samples_ts"], [tokens / (ns * 1e-9) for ns in r["samples_ns"]], rtol=1e-6)
        np.testing.assert_allclose([r["avg_ts"], r["stddev_ts"]], [np.mean(r["samples_ts"]), np.std(r["samples_ts"], ddof=1)])
        np.testing.assert_allclose([r["avg_ns"], r["stddev_ns"]], [np.mean(r["samples_ns"]), np.std(r["samples_ns"], ddof=1)],
                                   atol=1)
    result = powerinfer(*flags, "-o", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [(int(r["n_prompt"]), int(r["n_gen"])) for r in rows] == [(8, 0), (16, 0), (0, 2)]
    assert set(rows[0]) == set(records[0]) - {"samples_ns", "samples_ts"}
    assert result.stdout.splitlines()[1].startswith('"')  # values quoted, as llama-bench writes them


def test_bench_with_nothing_to_measure(default_model):
    assert_one_line_error(powerinfer("bench", "-m", str(default_model), "-p", "0", "-n", "0"), "nothing to measure")


def test_missing_model_file(tmp_path):
    assert_one_line_error(powerinfer("run", "-m", str(tmp_path / "none.gguf"), "-p", "hi"), "no such file")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a model")
    assert_one_line_error(powerinfer("run", "-m", str(path), "-p", "hi"), "not a GGUF")


def test_truncated_model(tmp_path, default_model):
    path = tmp_path / "cut.gguf"
    with open(default_model, "rb") as src:
        path.write_bytes(src.read(5_000_000))
    assert_one_line_error(powerinfer("run", "-m", str(path), "-p", "hi"), "truncated")


def test_unknown_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    write_gguf(path, "mamba", {}, [TensorData("w", np.zeros(4, np.float32), __import__("gguf").GGMLQuantizationType.F32)])
    assert_one_line_error(powerinfer("run", "-m", str(path), "-p", "hi"), "unsupported architecture 'mamba'")


def test_prompt_longer_than_context(default_model):
    assert_one_line_error(powerinfer("run", "-m", str(default_model), "-c", "16", "-p", "word " * 40), "does not fit")


@pytest.mark.parametrize("flags, fragment", [
    (["run", "-p", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "-p", "x", "--temp", "warm"], "invalid float value"),
    (["run", "-p", "x", "-t", "0"], "must be in [1, 4096]"),
    (["run"], "required"),
    (["fly"], "invalid choice"),
    (["run", "-p", "x", "-ctk", "q8_0"], "invalid choice: 'q8_0'"),
])
def test_bad_flags(flags, fragment):
    assert_one_line_error(powerinfer(*flags), fragment)


def test_bad_sampling_value(default_model):
    assert_one_line_error(powerinfer("run", "-m", str(default_model), "-p", "x", "--top-p", "3"), "argument --top-p: must be in (0, 1]")


def test_profile_defines_firing_for_silu_models(tiny_llama, wikitext_valid, tmp_path, capsys):
    """The README's `profile -f valid.txt -o prof/` works on SiLU models (like the default one) too."""
    from powerinfer.cli import main
    from powerinfer.sparse.profiler import ActivationProfile

    _, _, ggufs = tiny_llama
    text = tmp_path / "valid.txt"
    text.write_text(wikitext_valid[:20000])
    assert main(["profile", "-m", str(ggufs["f32"]), "-f", str(text), "-o", str(tmp_path / "prof"),
                 "--tokens", "1024", "--chunk", "256"]) == 0
    profile = ActivationProfile.load(tmp_path / "prof")
    notes = [line for line in capsys.readouterr().err.splitlines() if "--target-sparsity" in line]
    if profile.activation == "silu":
        assert profile.target_sparsity == 0.5 and len(notes) == 1
        assert all(abs(s - 0.5) < 0.05 for s in profile.sparsity)  # half of each layer under its threshold
    else:
        assert profile.target_sparsity is None and not notes
