"""The Python API contract: LLM(...).tokenize / detokenize / logits / generate / stream / chat."""

from __future__ import annotations

import numpy as np
import pytest

from powerinfer import LLM, PowerInferError


def test_tokenize_round_trip(default_llm):
    ids = default_llm.tokenize("Hello world, 2024!")
    assert all(isinstance(i, int) for i in ids)
    assert default_llm.detokenize(ids) == "Hello world, 2024!"


def test_logits_shape_and_dtype(default_llm):
    ids = default_llm.tokenize("The quick brown fox")
    logits = default_llm.logits(ids)
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32
    assert logits.shape == (len(ids), default_llm.config.n_vocab)


def test_seeded_generation_is_reproducible(default_llm):
    a = default_llm.generate("Once upon a time", max_tokens=20, seed=42, temperature=1.0)
    b = default_llm.generate("Once upon a time", max_tokens=20, seed=42, temperature=1.0)
    assert a == b and a


def test_stream_equals_generate(default_llm):
    expected = default_llm.generate("The history of Rome", max_tokens=24, temperature=0)
    stream = default_llm.generate_stream("The history of Rome", max_tokens=24, temperature=0)
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == expected == stream.completion.text
    assert stream.completion.finish_reason == "length" and len(stream.completion.tokens) == 24


def test_stop_string_ends_generation(default_llm):
    full = default_llm.generate("1, 2, 3, 4,", max_tokens=20, temperature=0)
    stop = full.strip()[2:5]
    completion = default_llm.complete("1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[stop])
    assert completion.finish_reason == "stop"
    assert stop not in completion.text
    assert full.startswith(completion.text)


def test_chat_uses_template_and_stops_at_end_of_turn(default_llm, smollm2_reference):
    messages = [{"role": "user", "content": "Which city is the capital of France?"}]
    expected_ids = smollm2_reference[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert default_llm.chat_prompt(messages) == list(getattr(expected_ids, "input_ids", expected_ids))
    completion = default_llm.complete(default_llm.chat_prompt(messages), temperature=0, max_tokens=64)
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop" and "<|im_end|>" not in completion.text
    assert default_llm.chat(messages, temperature=0, max_tokens=64) == completion.text


def test_max_tokens_zero(default_llm):
    assert default_llm.complete("Hello", max_tokens=0).text == ""


def test_bad_inputs(default_llm, tmp_path):
    with pytest.raises(PowerInferError, match="out of range"):
        default_llm.logits([0, 10**7])
    with pytest.raises(PowerInferError, match="does not fit"):
        default_llm.generate("word " * 3000, max_tokens=1)
    with pytest.raises(PowerInferError, match="no such file"):
        LLM(tmp_path / "missing.gguf")
    with pytest.raises(PowerInferError, match="dtype"):
        LLM(tmp_path / "missing.gguf", dtype="int3")
