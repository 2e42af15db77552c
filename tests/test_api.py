"""The Python API contract: LLM(...).tokenize / detokenize / logits / generate / stream / chat."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from powerinfer import LLM, PowerInferError

from helpers import CAPITAL_QUESTION


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
    messages = [{"role": "user", "content": CAPITAL_QUESTION}]
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


# ---------------------------------------------------------------- OpenAI-shaped API


def test_create_completion_parses_as_openai_types(default_llm):
    from openai.types import Completion

    prompt = "The capital of France is"
    answer = Completion.model_validate(default_llm.create_completion(prompt, max_tokens=8, temperature=0, logprobs=2))
    expected = default_llm.complete(prompt, max_tokens=8, temperature=0)
    assert answer.choices[0].text == expected.text and answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == expected.prompt_tokens and answer.usage.completion_tokens == 8
    assert len(answer.choices[0].logprobs.tokens) == 8 and all(len(t) == 2 for t in answer.choices[0].logprobs.top_logprobs)
    chunks = list(default_llm.create_completion(prompt, max_tokens=8, temperature=0, stream=True))
    # OpenAI streams text completions as Completion objects whose finish_reason is null until the
    # last one; its type only admits the last, and the others have the same fields.
    assert Completion.model_validate(chunks[-1]).choices[0].finish_reason == "length"
    assert all(c.keys() == chunks[-1].keys() and c["choices"][0].keys() == chunks[-1]["choices"][0].keys()
               for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    two = Completion.model_validate(default_llm.create_completion(prompt, max_tokens=4, n=2, seed=5))
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 8


def test_create_chat_completion_parses_as_openai_types(default_llm):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    messages = [{"role": "user", "content": "Name three rivers."}]
    answer = ChatCompletion.model_validate(default_llm.create_chat_completion(
        messages, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3))
    assert answer.choices[0].message.content == default_llm.chat(messages, max_tokens=16, temperature=0)
    assert [len(e.top_logprobs) for e in answer.choices[0].logprobs.content] == [3] * answer.usage.completion_tokens
    chunks = [ChatCompletionChunk.model_validate(c) for c in default_llm.create_chat_completion(
        messages, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens


def test_create_chat_completion_tools_and_json(default_llm):
    import jsonschema
    from openai.types.chat import ChatCompletion

    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}}]
    called = ChatCompletion.model_validate(default_llm.create_chat_completion(
        [{"role": "user", "content": "What is 2 plus 3?"}], tools=tools, tool_choice="required", temperature=0,
        max_tokens=40))
    call = called.choices[0].message.tool_calls[0]
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), tools[0]["function"]["parameters"])
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    answer = default_llm.create_chat_completion([{"role": "user", "content": "Name a city as JSON."}], temperature=0,
                                                max_tokens=40, response_format={
                                                    "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), schema)


def test_create_completion_refuses_bad_fields(default_llm):
    with pytest.raises(PowerInferError, match="presence_penalty"):
        default_llm.create_completion("x", presence_penalty="abc")
    with pytest.raises(PowerInferError, match="guided_whitespace_pattern"):
        default_llm.create_completion("x", guided_whitespace_pattern=r"\s*")
    with pytest.raises(PowerInferError, match="out of range"):
        default_llm.create_completion("x", logit_bias={"99999999": 1})


def test_embed_is_transformers_last_hidden_state_mean(default_llm, smollm2_reference):
    """Mean of the final normalized hidden states, unit length: transformers' hidden_states[-1]
    (after the model's final norm) of the same GGUF, dequantized."""
    tokenizer, model = smollm2_reference
    texts = ["The cat sat on the mat.", "Quantum chromodynamics describes the strong force."]
    ours = np.array(default_llm.embed(texts))
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    for text, vector in zip(texts, ours):
        ids = torch.tensor([default_llm.tokenize(text)])
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]
        reference = torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()
        assert float(vector @ reference) > 0.99  # cosine: ours runs the quantized weights
    assert float(ours[0] @ ours[1]) < 0.99  # different texts, different vectors


def test_token_bytes_spell_the_text(default_llm, wikitext_valid):
    """Logprobs' `bytes` and the grammar engine see each token's exact bytes: GPT-2's byte table
    (transformers' copy as the reference), and the bytes of a text's tokens join into the text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from powerinfer.runtime.token_bytes import token_bytes

    vocabulary = token_bytes(default_llm.tokenizer)
    table = {c: b for b, c in bytes_to_unicode().items()}
    for token in range(0, default_llm.config.n_vocab, 97):
        piece = default_llm.tokenizer.piece(token)
        if default_llm.tokenizer.types[token] == 1:  # normal tokens; control tokens give their text
            assert vocabulary[token] == bytes(table[c] for c in piece)
    for line in wikitext_valid.splitlines()[:300] + ["Héllo wörld, 日本語 🙂"]:
        ids = default_llm.tokenize(line, add_bos=False)
        assert b"".join(vocabulary[t] for t in ids) == line.encode()


def test_token_bytes_of_a_sentencepiece_vocabulary(sentencepiece_gguf, valid_lines):
    from powerinfer.gguf.reader import open_gguf
    from powerinfer.runtime.token_bytes import token_bytes
    from powerinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(open_gguf(sentencepiece_gguf))
    vocabulary = token_bytes(tokenizer)
    for line in valid_lines[:200] + ["Héllo wörld, 日本語 🙂"]:
        ids = tokenizer.encode(line, add_bos=False)
        assert b"".join(vocabulary[t] for t in ids) == (" " + line).encode()  # SentencePiece's leading space
