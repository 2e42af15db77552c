"""Tokenizer files of a Hugging Face checkpoint -> GGUF `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import TokenType
from gguf.vocab import LlamaHfVocab, SentencePieceVocab, SpecialVocab

from powerinfer.errors import UnsupportedModelError


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for the pre-tokenizer a tokenizer.json describes (its split regex)."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]
    if "Digits" in kinds and any(s.get("individual_digits") for s in steps):
        return "smollm"  # digits split one by one, then GPT-2's regex: smollm / starcoder
    for step in steps:
        pattern = (step.get("pattern") or {}).get("Regex", "") if step.get("type") == "Split" else ""
        if "\\p{N}{1,3}" in pattern:
            return "llama-bpe"
        if pattern.startswith("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"):
            return "qwen2"
    return "gpt2"


def _byte_level_bpe(folder: Path, spec: dict) -> dict[str, Any]:
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    types = {}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        types[added["id"]] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise UnsupportedModelError(f"{folder}: tokenizer ids are not contiguous")
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": _pre_tokenizer_name(spec.get("pre_tokenizer")),
        "tokenizer.ggml.tokens": [t for t, _ in by_id],
        "tokenizer.ggml.token_type": [int(types.get(i, TokenType.NORMAL)) for _, i in by_id],
    }


def _sentencepiece(folder: Path) -> dict[str, Any]:
    vocab = SentencePieceVocab(folder) if (folder / "tokenizer.model").exists() else LlamaHfVocab(folder)
    tokens, scores, types = zip(*vocab.all_tokens())
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in tokens],
        "tokenizer.ggml.scores": [float(s) for s in scores],
        "tokenizer.ggml.token_type": [int(t) for t in types],
    }


def tokenizer_metadata(folder: Path, n_vocab: int) -> dict[str, Any]:
    """Vocabulary, merges, special ids and chat template; {} when the folder has no tokenizer."""
    spec_path = folder / "tokenizer.json"
    spec = json.loads(spec_path.read_text()) if spec_path.exists() else None
    if spec is not None and spec["model"]["type"] == "BPE" and not spec["model"].get("byte_fallback"):
        meta = _byte_level_bpe(folder, spec)
    elif (folder / "tokenizer.model").exists() or spec is not None:
        meta = _sentencepiece(folder)
    else:
        return {}
    special = SpecialVocab(folder, load_merges=meta["tokenizer.ggml.model"] == "gpt2", n_vocab=n_vocab)
    if special.merges:
        meta["tokenizer.ggml.merges"] = list(special.merges)
    for kind, token_id in special.special_token_ids.items():
        meta[f"tokenizer.ggml.{'padding' if kind == 'pad' else 'unknown' if kind == 'unk' else kind}_token_id"] = int(token_id)
    for kind, value in special.add_special_token.items():
        meta[f"tokenizer.ggml.add_{kind}_token"] = bool(value)
    if isinstance(special.chat_template, str):
        meta["tokenizer.chat_template"] = special.chat_template
    return meta
