"""Tokenizers built from GGUF vocabularies, against tokenizers that no one here wrote."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import write_gguf
from powerinfer.tokenizer import BYTE, Tokenizer


@pytest.fixture(scope="module")
def smollm2(default_model) -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(default_model))


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_reference):
    return smollm2_reference[0]


def with_digit_split(hf_tokenizer):
    """transformers' GGUF reader builds SmolLM2's tokenizer without the digit split that both
    llama.cpp (pre-tokenizer "smollm") and SmolLM2's own tokenizer.json apply; put it back."""
    backend = hf_tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer])
    return hf_tokenizer


def test_smollm2_equals_transformers_on_every_validation_line(smollm2, smollm2_reference, valid_lines, default_model):
    from transformers import AutoTokenizer

    reference = with_digit_split(AutoTokenizer.from_pretrained(default_model.parent, gguf_file=default_model.name))
    ours = smollm2.encode_batch(valid_lines, add_bos=False)
    theirs = reference(valid_lines, add_special_tokens=False)["input_ids"]
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not mismatches, f"first mismatch on line {mismatches[0]}: {valid_lines[mismatches[0]][:80]!r}"


def test_unmodified_transformers_differs_only_on_non_ascii_numerals(smollm2, transformers_smollm2, valid_lines):
    ours = smollm2.encode_batch(valid_lines, add_bos=False)
    theirs = transformers_smollm2(valid_lines, add_special_tokens=False)["input_ids"]
    for line, a, b in zip(valid_lines, ours, theirs):
        if a != b:  # e.g. "½": numeric (Unicode category N) but not a digit 0-9
            assert any(unicodedata.category(c).startswith("N") and not c.isascii() for c in line), line


def test_smollm2_decode_round_trip(smollm2, valid_lines):
    for line, ids in zip(valid_lines, smollm2.encode_batch(valid_lines, add_bos=False)):
        assert smollm2.decode(ids) == line


def test_special_tokens_are_matched_whole(smollm2):
    im_start = smollm2.token_id("<|im_start|>")
    assert smollm2.encode("<|im_start|>user\nhi", add_bos=False)[0] == im_start
    assert smollm2.piece(smollm2.eos_id) == "<|im_end|>" and smollm2.eos_id in smollm2.eog_ids
    assert not smollm2.add_bos  # SmolLM2's GGUF asks for no BOS token


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."}],
])
def test_chat_template_equals_transformers(smollm2, transformers_smollm2, messages):
    expected = transformers_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm2.apply_chat_template(messages, add_generation_prompt=True) == expected


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40))
def test_streaming_decode_concatenates_to_decode(smollm2, text):
    ids = smollm2.encode(text, add_bos=False)
    decoder = smollm2.stream_decoder()
    pieces = [decoder.feed(i) for i in ids]
    pieces.append(decoder.flush())
    full = smollm2.decode(ids, skip_special=True)
    assert "".join(pieces) == full
    # A piece never ends inside a character (bytes missing from the vocabulary can still decode as U+FFFD).
    assert "\ufffd" in full or all("\ufffd" not in p for p in pieces)


# -- SentencePiece (llama) vocabularies ------------------------------------------------------------

SPM_SAMPLES = ["Hello world", "  two leading spaces", "digits 1234 and 3.14", "tabs\tand\nnewlines",
               "unicode: café, naïve, 東京, ½, emoji 😀🎉", "trailing space ", "", "x"]


def test_sentencepiece_equals_sentencepiece_library(sentencepiece_model, sentencepiece_gguf, valid_lines):
    ours = Tokenizer.from_gguf(open_gguf(sentencepiece_gguf))
    texts = SPM_SAMPLES + valid_lines[300:400]
    for text in texts:
        assert ours.encode(text, add_bos=False) == sentencepiece_model.encode(text), text
        assert ours.decode(ours.encode(text, add_bos=False)) == sentencepiece_model.decode(sentencepiece_model.encode(text))
    assert ours.encode("hi")[0] == sentencepiece_model.bos_id()


def test_sentencepiece_equals_transformers_gguf_reader(sentencepiece_gguf, valid_lines):
    """transformers' reading of a SentencePiece GGUF departs from SentencePiece and llama.cpp twice:
    it adds no "▁" prefix to text that starts with a space, and it reads the text "<unk>" as the
    unknown token. On text where neither applies the ids must be equal."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name)
    ours = Tokenizer.from_gguf(open_gguf(sentencepiece_gguf))
    texts = [t.lstrip() for t in SPM_SAMPLES + valid_lines[400:] if "<unk>" not in t]
    assert len(texts) > 150
    for text in texts:
        assert ours.encode(text, add_bos=False) == reference(text, add_special_tokens=False)["input_ids"], text


def test_byte_fallback_for_unseen_characters(sentencepiece_gguf):
    ours = Tokenizer.from_gguf(open_gguf(sentencepiece_gguf))
    ids = ours.encode("😀", add_bos=False)
    assert [ours.piece(i) for i in ids if ours.types[i] == BYTE] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert ours.decode(ids) == "😀"


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, "llama", {"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a", "b"]}, [])
    with pytest.raises(UnsupportedModelError, match="unsupported tokenizer model 'rwkv'"):
        Tokenizer.from_gguf(open_gguf(path))


def test_missing_vocabulary(tmp_path):
    path = tmp_path / "t.gguf"
    write_gguf(path, "llama", {"general.name": "no tokenizer"}, [])
    with pytest.raises(ModelFileError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf(open_gguf(path))
