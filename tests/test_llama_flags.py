"""Flags llama.cpp and vLLM users type: each works, or is accepted with one line saying why it has
no effect; the names a server answers to."""

from __future__ import annotations

import httpx
import openai
import pytest

from powerinfer.cli import parse_args
from powerinfer.commands.llama_flags import NO_EFFECT, note_flags_without_effect
from powerinfer.server.app import create_app
from powerinfer.server.model_names import ModelNames

from helpers import ServerThread, assert_error, assert_one_line_error, powerinfer

parse = parse_args


def test_run_accepts_llama_cpps_model_flags(default_model, default_llm):
    result = powerinfer("run", "-m", str(default_model), "-p", "The capital of France is", "-n", "4", "--temp", "0",
                        "-fa", "-ub", "64", "--no-mmap", "--mlock", "-ctk", "f32", "-ctv", "f32", "-b", "64", "-c", "256")
    assert result.returncode == 0, result.stderr
    assert result.stdout == default_llm.generate("The capital of France is", max_tokens=4, temperature=0) + "\n"
    notes = [line for line in result.stderr.splitlines() if line.startswith("powerinfer: -") and "no" in line]
    for dest in ("ubatch_size", "flash_attn", "no_mmap", "mlock"):
        assert sum(line == f"powerinfer: {NO_EFFECT[dest]}" for line in result.stderr.splitlines()) == 1, notes
    assert "-f VALUE" not in result.stderr


@pytest.mark.parametrize("argv, dests", [
    (["serve", "-fa"], ["flash_attn"]),
    (["serve", "-fa", "on", "--embeddings", "--metrics", "-cb", "--jinja"], ["flash_attn", "embeddings", "metrics",
                                                                             "cont_batching"]),
    (["chat", "--flash-attn", "off", "--no-mmap"], ["flash_attn", "no_mmap"]),
    (["serve"], []),
])
def test_flags_without_effect_say_so_once(capsys, argv, dests):
    note_flags_without_effect(parse(argv))
    assert capsys.readouterr().err.splitlines() == [f"powerinfer: {NO_EFFECT[dest]}" for dest in dests]


def test_batch_size_and_cache_types_work(default_model):
    from powerinfer.commands.generation_flags import generation_settings
    from powerinfer.commands.model_flags import load_llm

    args = parse(["run", "-m", str(default_model), "-b", "64", "-ctv", "f32", "-c", "128"])
    llm = load_llm(args, **generation_settings(args))
    assert llm.n_batch == 64 and llm.cache_type == "f32" and llm.n_ctx == 128
    assert_one_line_error(powerinfer("run", "-m", str(default_model), "-p", "x", "-ctk", "f16", "-ctv", "f32"),
                          "-ctk f16 and -ctv f32 differ")


def test_served_names_from_the_flags():
    from powerinfer.server.startup import app_options

    assert app_options(parse(["serve", "--alias", "a", "b", "--served-model-name", "c", "a"]))["model_names"] == \
        ModelNames(("a", "b", "c"), False)
    assert app_options(parse(["serve", "--strict-model-name"]))["model_names"] == ModelNames((), True)


@pytest.fixture(scope="module", params=[False, True], ids=["lenient", "strict"])
def named_server(request, default_llm):
    running = ServerThread(create_app(default_llm, model_names=ModelNames(("tiny-chat", "gpt-4o-mini"), request.param)))
    yield running, request.param
    running.stop()


def test_aliases_name_the_model(named_server, default_llm):
    server, strict = named_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny-chat", "gpt-4o-mini"]
    for name in ("gpt-4o-mini", default_llm.path.name, default_llm.path.stem):
        answer = client.completions.create(model=name, prompt="The capital of France is", max_tokens=3, temperature=0)
        assert answer.model == "tiny-chat"
        assert answer.choices[0].text == default_llm.generate("The capital of France is", max_tokens=3, temperature=0)
    other = httpx.post(f"{server.url}/v1/completions", json={"model": "llama-70b", "prompt": "x", "max_tokens": 1},
                       timeout=60)
    if strict:
        assert assert_error(other, 404, "model")["code"] == "model_not_found"
        path = str(default_llm.path)
        assert_error(httpx.post(f"{server.url}/v1/completions", json={"model": path, "prompt": "x"}), 404, "model")
    else:
        assert other.status_code == 200 and other.json()["model"] == "tiny-chat"


@pytest.mark.parametrize("text, expected", [("1,2", [1, 2]), ("1-4", [1, 2, 3, 4]), ("64-512*2", [64, 128, 256, 512]),
                                            ("1-9+4,16", [1, 5, 9, 16])])
def test_bench_takes_llama_benchs_list_forms(text, expected):
    assert parse(["bench", "-t", text]).threads == expected
    assert parse(["bench", "-p", text, "-n", text]).n_prompt == expected


@pytest.mark.parametrize("text", ["4-1", "1-8*1", "a-b", "1,,2"])
def test_bad_lists_are_one_line(text, tmp_path):
    assert_one_line_error(powerinfer("bench", "-m", str(tmp_path / "none.gguf"), "-t", text), "argument -t/--threads")


def test_bench_threads_backend_label_and_sparsity(default_model, tmp_path):
    """The label is general.file_type's as llama-bench prints it (here a file stamped Q4_K_M), the
    backend the instruction set the kernels ran with, one run of the tests per thread count."""
    import json

    from gguf import GGUFValueType

    from powerinfer.convert.model import gguf_source, write_model
    from powerinfer.ops import native

    source = gguf_source(default_model)
    source.typed_metadata["general.file_type"] = (15, GGUFValueType.UINT32, None)
    stamped = tmp_path / "stamped.gguf"
    write_model(source, stamped, progress=False)
    result = powerinfer("bench", "-m", str(stamped), "-p", "8", "-n", "2", "-r", "1", "-t", "1,2", "-o", "jsonl")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["n_threads"], r["n_prompt"], r["n_gen"]) for r in records] == [(1, 8, 0), (1, 0, 2), (2, 8, 0), (2, 0, 2)]
    ops = native.load()
    assert {r["backends"] for r in records} == {"CPU (torch)" if ops is None else f"CPU ({native.kernels_label()})"}
    assert {r["sparsity"] for r in records} == {"off"}
    assert all(r["model_type"].endswith(" Q4_K - Medium") for r in records)
