"""Hyper-parameters read from GGUF metadata: values no model can have are refused with one line."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer.config import ModelConfig
from powerinfer.errors import ModelFileError, PowerInferError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import write_gguf
from powerinfer.models import read_config

from helpers import assert_one_line_error, powerinfer

TOKENS = [f"t{i}" for i in range(32)]
# SmolLM2-135M's shape, with a 32-token vocabulary
METADATA = {
    "llama.block_count": 30, "llama.context_length": 8192, "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536, "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
    "llama.rope.freq_base": 100000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.dimension_count": 64, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS,
}


def config_of(tmp_path, **changes) -> ModelConfig:
    """The config of a metadata-only llama file with `changes` (keys without "llama.", dots as __;
    None removes a key)."""
    metadata = dict(METADATA)
    for name, value in changes.items():
        key = name.replace("__", ".")
        key = key if key.startswith("tokenizer") else f"llama.{key}"
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", metadata, [])
    return read_config(open_gguf(path))


def test_valid_metadata(tmp_path):
    config = config_of(tmp_path)
    assert (config.n_head, config.n_head_kv, config.head_dim, config.n_vocab) == (9, 3, 64, 32)


@pytest.mark.parametrize("changes, message", [
    ({"attention__head_count": 0}, "head_count 0 must be > 0"),
    ({"attention__head_count": -9}, "head_count -9 must be > 0"),
    ({"attention__head_count_kv": 0}, "head_count_kv 0 must be > 0"),
    ({"attention__head_count_kv": 2}, "head_count 9 is not a multiple of attention.head_count_kv 2"),
    ({"embedding_length": 577}, "embedding_length 577 is not a multiple of attention.head_count 9"),
    ({"embedding_length": 0}, "embedding_length 0 must be > 0"),
    ({"attention__key_length": 0}, "key_length 0 must be > 0"),
    ({"block_count": 0}, "block_count 0 must be > 0"),
    ({"feed_forward_length": 0}, "feed_forward_length 0 must be > 0"),
    ({"context_length": 0}, "context_length 0 must be > 0"),
    ({"rope__dimension_count": 63}, "rope.dimension_count 63 must be even"),
    ({"rope__dimension_count": 128}, "rope.dimension_count 128 must be even and in 1..64"),
    ({"rope__freq_base": -1.0}, "rope.freq_base -1.0 must be > 0"),
    ({"rope__freq_base": math.nan}, "not a finite number"),
    ({"rope__freq_base": math.inf}, "not a finite number"),
    ({"attention__layer_norm_rms_epsilon": 0.0}, "epsilon 0.0 must be > 0"),
    ({"vocab_size": 100}, "vocab_size 100 but 32 tokens"),
    ({"embedding_length": "576"}, "llama.embedding_length is '576', not a finite number"),
    ({"attention__head_count": [9] * 30}, "not a finite number"),
    ({"attention__head_count": True}, "not a finite number"),
])
def test_impossible_values_are_refused(tmp_path, changes, message):
    with pytest.raises(ModelFileError, match=message) as error:
        config_of(tmp_path, **changes)
    assert "\n" not in str(error.value)


def test_head_count_zero_on_the_command_line(tmp_path):
    """Issue 16: such a file used to fail at the first token with a traceback and exit 1."""
    path = tmp_path / "heads.gguf"
    write_gguf(path, "llama", {**METADATA, "llama.attention.head_count": 0}, [])
    assert_one_line_error(powerinfer("run", "-m", str(path), "-p", "hi"), "head_count 0 must be > 0")


VALUES = st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                   st.booleans(), st.lists(st.integers(0, 100), max_size=3))


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.sampled_from([k for k in METADATA if k != "tokenizer.ggml.model"]
                                       + ["llama.attention.key_length", "llama.vocab_size"]), VALUES, min_size=1))
def test_fuzzed_metadata_loads_or_fails_with_one_line(tmp_path_factory, changes):
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    try:
        write_gguf(path, "llama", {**METADATA, **changes}, [])
    except (TypeError, ValueError, OverflowError):  # a value the gguf writer cannot store
        return
    try:
        config = read_config(open_gguf(path))
    except PowerInferError as error:
        assert "\n" not in str(error)
        return
    assert config.n_head % config.n_head_kv == 0 and config.head_dim > 0 and config.norm_eps > 0
