"""Tokenizers built from a GGUF vocabulary with the `tokenizers` library, and chat templates.

Two vocabulary kinds, as llama.cpp reads them:
- `gpt2`: byte-level BPE from tokens + merges, split first by the regexes llama.cpp uses for
  `tokenizer.ggml.pre`;
- `llama`: SentencePiece BPE from tokens + scores, with byte fallback (`<0xNN>` tokens).
Control tokens (type 3) and user-defined tokens (type 4) are matched whole in the input text.
"""

from __future__ import annotations

import json
import warnings
from array import array
from collections.abc import Sequence
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from powerinfer.chat_formats import BUILT_IN, chosen_template, detect
from powerinfer.chat_template import ChatTemplate
from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.logs import capped

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)")
# The split regexes llama.cpp applies, in order, per `tokenizer.ggml.pre` (llama-vocab.cpp).
PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    "gpt2": [GPT2_SPLIT], "default": [GPT2_SPLIT], "mpt": [GPT2_SPLIT], "olmo": [GPT2_SPLIT], "jais": [GPT2_SPLIT],
    "smollm": [r"\p{N}", GPT2_SPLIT], "starcoder": [r"\p{N}", GPT2_SPLIT], "refact": [r"\p{N}", GPT2_SPLIT],
    "command-r": [r"\p{N}", GPT2_SPLIT], "codeshell": [r"\p{N}", GPT2_SPLIT], "exaone": [r"\p{N}", GPT2_SPLIT],
    "minerva-7b": [r"\p{N}", GPT2_SPLIT],
    "llama3": [LLAMA3_SPLIT], "llama-v3": [LLAMA3_SPLIT], "llama-bpe": [LLAMA3_SPLIT], "falcon3": [LLAMA3_SPLIT],
    "smaug-bpe": [LLAMA3_SPLIT], "dbrx": [LLAMA3_SPLIT], "pixtral": [LLAMA3_SPLIT],
    "qwen2": [QWEN2_SPLIT], "deepseek-r1-qwen": [QWEN2_SPLIT],
}
# Vocabularies trained to map whole words to tokens when they exist (BPE's ignore_merges).
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}
# Token texts that end a turn, besides the file's eos/eot/eom ids (llama.cpp's list).
END_OF_GENERATION_TEXTS = {"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                           "</s>", "<|end_of_text|>", "<|return|>", "<|call|>"}


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str) -> Backend:
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        warnings.warn(f"unknown pre-tokenizer {pre!r}; using GPT-2's split", stacklevel=3)
        splits = [GPT2_SPLIT]
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=pre in IGNORE_MERGES))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges are implied by scores: a pair merges when the joined piece exists,
    higher-scoring results first (the order Hugging Face's converter derives).

    Kept as token ids until the end, and the pairs hold the vocabulary's own strings: a 262k-token
    vocabulary has ~515k merges, and per-merge Python objects cost ~150 MB more at the peak."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    lefts, rights, merged = array("i"), array("i"), array("i")
    for piece, i in vocab.items():
        splits = sorted((vocab[piece[:k]], vocab[piece[k:]]) for k in range(1, len(piece))
                        if piece[:k] in vocab and piece[k:] in vocab)
        for left, right in splits:
            lefts.append(left)
            rights.append(right)
            merged.append(i)
    # stable: merges of equal score keep the order above
    order = np.argsort(-np.asarray(scores, dtype=np.float64)[np.asarray(merged, dtype=np.int64)], kind="stable")
    return [(tokens[lefts[j]], tokens[rights[j]]) for j in order.tolist()]


def _sentencepiece_backend(tokens: list[str], scores: list[float], types: list[int], unk_id: int | None,
                           add_space_prefix: bool) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Backend(models.BPE(vocab, _spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    # llama.cpp puts a space before every run of text that starts the input or follows a special
    # token, then spells spaces as "▁"; a normalizer does that per run between added tokens.
    # (The Metaspace pre-tokenizer would skip the prefix when the text already starts with a space.)
    backend.normalizer = normalizers.Sequence(
        [*([normalizers.Prepend("▁")] if add_space_prefix else []), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
    ])
    return backend


def _check_tokens(path: object, tokens: list[str]) -> None:
    """Refuse what the tokenizer library cannot map both ways: an empty token or a repeated one (no
    vocabulary llama.cpp ships has either)."""
    first: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not token:
            raise ModelFileError(f"{path}: tokenizer token {i} is empty")
        if token in first:
            raise ModelFileError(f"{path}: tokenizer token {i} repeats token {first[token]} ({capped(repr(token), 60)})")
        first[token] = i


def _check_merges(path: object, merges: list[str], tokens: list[str]) -> None:
    """Each BPE merge is two vocabulary pieces separated by one space, and joins into a piece."""
    vocabulary = set(tokens)
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not all(part in vocabulary for part in parts):
            raise ModelFileError(f"{path}: tokenizer merge {i} ({capped(repr(merge), 60)}) is not two tokens of "
                                 "the vocabulary separated by a space")


class FIMTokens(NamedTuple):
    """The tokens that mark a fill-in-the-middle prompt: prefix, then suffix, then the middle to write."""

    prefix: int
    suffix: int
    middle: int


# llama.cpp's keys for them, else the token texts the families that have them use.
FIM_KEYS = ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.fim_mid_token_id")
FIM_TEXTS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
             ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"), ("<PRE>", "<SUF>", "<MID>"))


def _fim_tokens(gguf: GGUFFile, backend: Backend, n_vocab: int) -> FIMTokens | None:
    ids = [gguf.get(key) for key in FIM_KEYS]
    if all(isinstance(i, int) and 0 <= i < n_vocab for i in ids):
        return FIMTokens(*ids)
    for texts in FIM_TEXTS:
        found = [backend.token_to_id(text) for text in texts]
        if None not in found:
            return FIMTokens(*found)
    return None


class Tokenizer:
    """Text <-> token ids for one model, plus its special tokens and chat template."""

    def __init__(self, backend: Backend, types: list[int], bos_id: int | None,
                 eos_id: int | None, add_bos: bool, eog_ids: frozenset[int], chat_template: str | None,
                 chat_template_origin: str = "the model file", fim_ids: FIMTokens | None = None):
        self.backend = backend
        self.types = bytes(types)  # compact: one byte per token (the pieces live in the backend)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.eog_ids = eog_ids
        self.chat_template = chat_template
        self.chat_template_origin = chat_template_origin  # "the model file", "built-in gemma", a path, ...
        self.fim_ids = fim_ids  # fill-in-the-middle markers, when the vocabulary has them
        self._template = None

    def use_chat_template(self, spec: str) -> None:
        """Render chats with `spec` instead: a built-in name, a template file or a template's text."""
        self.chat_template, self.chat_template_origin = chosen_template(spec)
        self._template = None

    @property
    def n_vocab(self) -> int:
        return len(self.types)

    def piece(self, token_id: int) -> str:
        """The vocabulary entry of a token, as the file spells it (e.g. "Ġthe", "<0x0A>")."""
        return self.backend.id_to_token(token_id)

    def token_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        kind = gguf.get("tokenizer.ggml.model")
        tokens = gguf.get("tokenizer.ggml.tokens")
        if kind is None or not tokens:
            raise ModelFileError(f"{gguf.path}: no tokenizer vocabulary in the file")
        types = list(gguf.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
        if not all(0 <= t < 256 for t in types):
            raise ModelFileError(f"{gguf.path}: invalid tokenizer token types")
        if len(types) != len(tokens):
            raise ModelFileError(f"{gguf.path}: tokenizer has {len(tokens)} tokens but {len(types)} token types")
        _check_tokens(gguf.path, tokens)
        if kind == "gpt2":
            merges = gguf.get("tokenizer.ggml.merges")
            if not merges:
                raise ModelFileError(f"{gguf.path}: BPE tokenizer without merges")
            _check_merges(gguf.path, merges, tokens)
            backend = _byte_level_backend(tokens, merges, gguf.get("tokenizer.ggml.pre", "default"))
            default_add_bos = False
        elif kind == "llama":
            scores = gguf.get("tokenizer.ggml.scores")
            if not scores or len(scores) != len(tokens):
                raise ModelFileError(f"{gguf.path}: SentencePiece tokenizer without one score per token")
            backend = _sentencepiece_backend(tokens, scores, types, gguf.get("tokenizer.ggml.unknown_token_id"),
                                             bool(gguf.get("tokenizer.ggml.add_space_prefix", True)))
            default_add_bos = True
        else:
            raise UnsupportedModelError(f"{gguf.path}: unsupported tokenizer model {kind!r} (supported: gpt2, llama)")
        # Control and user-defined tokens are matched whole in the text (so chat templates work).
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty == CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == USER_DEFINED])
        bos_id, eos_id = gguf.get("tokenizer.ggml.bos_token_id"), gguf.get("tokenizer.ggml.eos_token_id")
        eog = {i for i in (eos_id, gguf.get("tokenizer.ggml.eot_token_id"), gguf.get("tokenizer.ggml.eom_token_id"))
               if i is not None and 0 <= i < len(tokens)}
        eog |= {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_GENERATION_TEXTS}
        template, origin = gguf.get("tokenizer.chat_template"), "the model file"
        if not template:  # as the model was tuned to chat, read from its architecture and vocabulary
            name = detect(gguf.get("general.architecture", ""), lambda piece: backend.token_to_id(piece) is not None)
            template, origin = BUILT_IN[name], f"built-in {name}"
        return cls(backend, types, bos_id, eos_id,
                   bool(gguf.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos_id is not None,
                   frozenset(eog), template, origin, _fim_tokens(gguf, backend, len(tokens)))

    # -- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        """Token ids of `text`, special tokens' texts read as those tokens unless `special` is false
        (then as plain text, as llama.cpp's parse_special=false); BOS first when `add_bos` and the
        model wants it."""
        return self.encode_batch([text], add_bos, special)[0]  # encode_batch releases the GIL; encode holds it

    def encode_batch(self, texts: Sequence[str], add_bos: bool = True, special: bool = True) -> list[list[int]]:
        prefix = [self.bos_id] if add_bos and self.add_bos else []
        encoded = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        if not special:  # only texts that held a special token's text read differently as plain text
            redo = [i for i, ids in enumerate(encoded) if any(self.types[t] == CONTROL for t in ids)]
            for i, e in zip(redo, self._plain_backend.encode_batch([texts[i] for i in redo], add_special_tokens=False)):
                encoded[i] = e.ids
        return [prefix + ids for ids in encoded]

    @cached_property
    def _plain_backend(self) -> Backend:
        """The backend without its special tokens (only made when a text needs it)."""
        spec = json.loads(self.backend.to_str())
        spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["special"]]
        return Backend.from_str(json.dumps(spec))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation with the chat template (the file's, else a built-in one), in a
        sandbox with a time and memory budget (any failure raises `ChatTemplateError`); `tools`
        (OpenAI function definitions) go to templates that render them."""
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        special = lambda i: self.piece(i) if i is not None and 0 <= i < self.n_vocab else ""  # noqa: E731
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=special(self.bos_id), eos_token=special(self.eos_id),
                                     **({} if tools is None else {"tools": tools}))


class StreamDecoder:
    """Turns token ids, fed one at a time, into text pieces without splitting a UTF-8 character.

    Each piece is the difference between decoding a short window with and without the newest
    tokens (how vLLM and transformers stream): byte-level and byte-fallback tokens may hold part of
    a character, and such a piece is held back until the character is complete.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def _text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special=True)

    def feed(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._text(self.prefix_offset, self.read_offset)
        after = self._text(self.prefix_offset, len(self.ids))
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        before = self._text(self.prefix_offset, self.read_offset)
        after = self._text(self.prefix_offset, len(self.ids))
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before):]
