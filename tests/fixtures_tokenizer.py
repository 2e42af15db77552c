"""Helpers for the tokenizer tests: where the SmolLM2 file is, tokenizer-only GGUF files, and a tiny
SentencePiece model trained here (its library is the reference for llama-style vocabularies)."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gguf import GGUFWriter

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp reads these before the vocabulary even when it loads only the vocabulary, so the
# tokenizer-only files carry them to stay loadable by llama-cpp-python.
LLAMA_HPARAMS: dict[str, Any] = {
    "llama.context_length": 2048, "llama.embedding_length": 64, "llama.block_count": 1,
    "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 4,
    "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.dimension_count": 16,
}


def smollm2_path() -> Path | None:
    """$POWERINFER_TEST_MODEL, else the cached default model, else None."""
    if "POWERINFER_TEST_MODEL" in os.environ:
        return Path(os.environ["POWERINFER_TEST_MODEL"])
    cached = Path.home() / ".cache" / "powerinfer" / "models" / SMOLLM2_FILE
    return cached if cached.exists() else None


def write_gguf(path: Path, metadata: dict[str, Any], architecture: str = "llama") -> Path:
    """A GGUF holding only metadata (no tensors), written with the `gguf` package itself.

    Python values map to GGUF types the way llama.cpp expects them for tokenizer keys: int -> u32,
    float -> f32, lists of ints -> i32 arrays (token types), lists of floats -> f32 (scores).
    """
    writer = GGUFWriter(path, architecture)
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def train_sentencepiece(lines: Iterable[str], vocab_size: int, user_defined: list[str]):
    """A BPE SentencePiece model configured the way Llama's is (no normalization, byte fallback)."""
    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=0.9995, user_defined_symbols=user_defined, minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def sentencepiece_metadata(sp, user_defined: list[str]) -> dict[str, Any]:
    """The `tokenizer.ggml.*` keys llama.cpp's converter writes for a SentencePiece model."""
    from powerinfer.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return UNKNOWN
        if sp.is_control(i):
            return CONTROL
        if sp.is_byte(i):
            return BYTE
        if sp.is_unused(i):
            return UNUSED
        return USER_DEFINED if sp.id_to_piece(i) in user_defined else NORMAL  # the API has no is_user_defined

    n = sp.get_piece_size()
    return {
        **LLAMA_HPARAMS,
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": True,
    }
