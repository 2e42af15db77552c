"""Text <-> token ids from a GGUF vocabulary, built with the `tokenizers` library; chat templates.

Two vocabulary kinds (`tokenizer.ggml.model`), read the way llama.cpp's llama-vocab.cpp reads them:
- `gpt2`: byte-level BPE from tokens + merges. Text is first split by the regexes llama.cpp picks
  for `tokenizer.ggml.pre`, then each piece is spelled in GPT-2's byte alphabet.
- `llama`: SentencePiece BPE from tokens + scores: spaces become "▁", a "▁" is put in front of the
  text and after every special token, and characters missing from the vocabulary fall back to
  `<0xNN>` byte tokens.
Control and unknown tokens (and user-defined ones) are matched whole in the text before any of
that, as llama.cpp does when asked to parse special tokens, so rendered chat templates encode right.
"""

from __future__ import annotations

import codecs
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from powerinfer.errors import ModelFileError, PowerInferError, UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile

# `tokenizer.ggml.token_type` values (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# -- pre-tokenizers of byte-level vocabularies -------------------------------------------------------
# The regexes are those of llama-vocab.cpp (as written in the models' tokenizer.json where llama.cpp
# had to rewrite them for std::regex). Several are applied in turn, each splitting every piece the
# previous one left, keeping both the matches and the text between them.

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
          r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
              r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole vocabulary entry is not merged up from bytes
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


def _named(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


# `tokenizer.ggml.pre` -> how llama.cpp splits text (llama_vocab::impl::load and llm_tokenizer_bpe).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_named("default", PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    **_named("gpt-2 phi-2 jina-es jina-de gigachat jina-v1-en jina-v2-es jina-v2-de jina-v2-code roberta-bpe "
             "a.x-4.0 mellum modern-bert mpt olmo jais trillion granite-docling exaone4", PreTokenizer((GPT2,))),
    **_named("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2",
             PreTokenizer((r"\p{N}", GPT2))),  # digits one by one
    **_named("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)),
    **_named("dbrx smaug-bpe chatglm-bpe glm4", PreTokenizer((LLAMA3,))),
    **_named("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", PreTokenizer((QWEN2,))),
    **_named("qwen35", PreTokenizer((QWEN35,))),
    **_named("tekken", PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True)),
    **_named("gpt-4o llama4 kanana2 talkie minimax-m2", PreTokenizer((GPT4O,))),
    **_named("seed-coder", PreTokenizer((SEED_CODER,))),
    **_named("falcon", PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"))),
    **_named("poro-chat bloom gpt3-finnish", PreTokenizer((BLOOM,))),
    **_named("viking", PreTokenizer((BLOOM, r"\p{N}"))),
}

# Tokens that end a turn, found by their text as llama.cpp does (it makes them control tokens too).
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
    "<|end_of_text|>", "<end_of_utterance>",
})
# Fill-in-the-middle separators also stop generation in llama.cpp (its FIM_PAD, FIM_REP, FIM_SEP).
FIM_END_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
})
FIM_END_KEYS = ("fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the others are moved past U+00FF."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


BYTE_OF_CHAR = {char: byte for byte, char in _bytes_to_unicode().items()}


def _byte_level_backend(tokens: list[str], merges: list[str], pre: PreTokenizer) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    # llama.cpp splits a merge at its first space after the first character.
    pairs = [(m[:cut], m[cut + 1:]) for m in merges if (cut := m.find(" ", 1)) > 0]
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges two neighbours whenever their concatenation is a piece, best score first;
    as BPE merges that is every split of every piece into two pieces, ranked by the joined piece's
    score (the ranking transformers derives too)."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    found = []
    for piece, i in vocab.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((left, right, scores[i]) for left, right in splits)
    found.sort(key=lambda merge: merge[2], reverse=True)  # stable: ties keep vocabulary order
    return [(left, right) for left, right, _ in found]


def _sentencepiece_backend(tokens: list[str], scores: list[float], types: list[int], unk_id: int | None,
                           add_space_prefix: bool) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    backend = Backend(models.BPE(vocab, _spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    # A normalizer runs on each stretch of text between matched special tokens, which is where
    # llama.cpp adds its "▁" prefix. (The Metaspace pre-tokenizer would add it only at the start of
    # the input, and not at all when the text already starts with a space.)
    prefix = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
    ])
    return backend


def _metadata_list(gguf: GGUFFile, key: str, kind: type | tuple[type, ...], n: int | None = None) -> list | None:
    """The array under `key` (None when absent), checked to hold `kind` values, `n` of them if given."""
    values = gguf.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or not all(isinstance(v, kind) for v in values):
        raise ModelFileError(f"{gguf.path}: {key} is not an array of the expected type")
    if n is not None and len(values) != n:
        raise ModelFileError(f"{gguf.path}: {key} has {len(values)} entries for {n} tokens")
    return values


class Tokenizer:
    """Text <-> token ids for one model, its special tokens, and its chat template."""

    def __init__(self, backend: Backend, model: str, types: list[int], bos_id: int | None, eos_id: int | None,
                 unk_id: int | None, pad_id: int | None, add_bos: bool, eog_ids: frozenset[int],
                 chat_template: str | None):
        self._backend = backend
        self.model = model  # "gpt2" or "llama"
        self._types = bytes(types)  # one byte per token (the token texts live in the backend)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = bos_id, eos_id, unk_id, pad_id
        self.add_bos = add_bos
        self.eog_ids = eog_ids
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> Tokenizer:
        model = gguf.get("tokenizer.ggml.model")
        tokens = _metadata_list(gguf, "tokenizer.ggml.tokens", str)
        if model is None or not tokens:
            raise ModelFileError(f"{gguf.path}: no tokenizer vocabulary in the file")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(f"{gguf.path}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")
        if len(set(tokens)) != len(tokens):
            raise ModelFileError(f"{gguf.path}: the tokenizer vocabulary has duplicate tokens")
        n = len(tokens)
        types = _metadata_list(gguf, "tokenizer.ggml.token_type", int, n) or [NORMAL] * n
        if not all(0 <= t <= BYTE for t in types):
            raise ModelFileError(f"{gguf.path}: tokenizer.ggml.token_type has values outside 0..{BYTE}")

        def token_id(key: str, default: int | None = None) -> int | None:
            value = gguf.get(f"tokenizer.ggml.{key}", default)
            return value if isinstance(value, int) and 0 <= value < n else None  # llama.cpp ignores bad ids

        # Texts llama.cpp treats as end-of-generation become control tokens whatever the file says.
        eog = {i for i, t in enumerate(tokens) if t in END_OF_GENERATION_TEXTS}
        types = [CONTROL if i in eog else t for i, t in enumerate(types)]
        eog |= {i for i, t in enumerate(tokens) if t in FIM_END_TEXTS}
        eog |= {token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id", *FIM_END_KEYS)}
        eog.discard(None)

        if model == "gpt2":
            merges = _metadata_list(gguf, "tokenizer.ggml.merges", str)
            if not merges:
                raise ModelFileError(f"{gguf.path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
            pre_name = gguf.get("tokenizer.ggml.pre")
            if pre_name is None:
                warnings.warn(f"{gguf.path}: no tokenizer.ggml.pre; splitting text as llama.cpp's 'default'",
                              stacklevel=2)
                pre_name = "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                warnings.warn(f"{gguf.path}: unknown tokenizer.ggml.pre {pre_name!r}; splitting text with GPT-2's "
                              "regex, tokens may differ from the model's own tokenizer", stacklevel=2)
                pre = PreTokenizer((GPT2,))
            backend = _try_build(gguf, _byte_level_backend, tokens, merges, pre)
            bos_id, eos_id, unk_id, add_bos = token_id("bos_token_id"), token_id("eos_token_id"), None, pre.add_bos
        else:
            scores = _metadata_list(gguf, "tokenizer.ggml.scores", (float, int), n)
            if scores is None:
                raise ModelFileError(f"{gguf.path}: SentencePiece tokenizer without tokenizer.ggml.scores")
            # llama.cpp's defaults for SentencePiece files that name no special tokens.
            bos_id, eos_id, unk_id = token_id("bos_token_id", 1), token_id("eos_token_id", 2), token_id(
                "unknown_token_id", 0)
            add_space_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
            backend = _try_build(gguf, _sentencepiece_backend, tokens, scores, types, unk_id, add_space_prefix)
            add_bos = True
        add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", add_bos))
        if add_bos and bos_id is None:
            raise ModelFileError(f"{gguf.path}: the tokenizer asks for a BOS token but names none")

        # Special (control, unknown) tokens are skipped when decoding with skip_special; user-defined ones never.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == USER_DEFINED])
        return cls(backend, model, types, bos_id, eos_id, unk_id, token_id("padding_token_id"), add_bos,
                   frozenset(eog), gguf.get("tokenizer.chat_template"))

    @property
    def n_vocab(self) -> int:
        return len(self._types)

    def piece(self, token_id: int) -> str:
        """The vocabulary entry as the file spells it (e.g. "Ġthe", "▁the", "<0x0A>")."""
        return self._backend.id_to_token(token_id)

    def token_id(self, piece: str) -> int | None:
        return self._backend.token_to_id(piece)

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    # -- text -> ids ---------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, special tokens parsed; BOS first when `add_bos` and the model wants one."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (in parallel threads)."""
        prefix = [self.bos_id] if add_bos and self.add_bos else []
        return [prefix + e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    # -- ids -> text ---------------------------------------------------------------------------------

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`; SentencePiece's "▁" prefix on the first token is dropped, so that
        decode(encode(text, add_bos=False)) == text."""
        ids = [int(i) for i in ids]
        if ids and not 0 <= min(ids) <= max(ids) < self.n_vocab:
            raise ValueError(f"token ids outside the vocabulary of {self.n_vocab}: {ids}")
        return self._backend.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for, as llama.cpp's token_to_piece gives them (no prefix removed).

        A byte-level or `<0xNN>` token may hold part of a UTF-8 character. Control and unknown tokens
        give their text, or nothing when `special` is false.
        """
        piece, kind = self.piece(token_id), self._types[token_id]
        if kind in (CONTROL, UNKNOWN):
            return piece.encode() if special else b""
        if kind == USER_DEFINED:
            return piece.encode()
        if kind == BYTE:
            return bytes([int(piece[3:5], 16)])
        if kind != NORMAL:  # unused and undefined tokens have no text
            return b""
        if self.model == "llama":
            return piece.replace("▁", " ").encode()
        return bytes(BYTE_OF_CHAR[c] for c in piece) if all(c in BYTE_OF_CHAR for c in piece) else piece.encode()

    def token_text(self, token_id: int) -> str:
        """A token's text (U+FFFD where it holds only part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    # -- chat ----------------------------------------------------------------------------------------

    @cached_property
    def _template(self) -> Template:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        # transformers' tojson: no HTML escaping, non-ASCII kept
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        try:
            return env.from_string(self.chat_template or CHATML_TEMPLATE)
        except TemplateError as error:
            raise PowerInferError(f"the model's chat template does not parse: {_one_line(error)}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render a conversation with the model's template (ChatML when the file has none), with the
        variables transformers gives it."""
        def text(i: int | None) -> str:
            return self.piece(i) if i is not None else ""

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                bos_token=text(self.bos_id), eos_token=text(self.eos_id), unk_token=text(self.unk_id),
                pad_token=text(self.pad_id),
            )
        except (TemplateError, TypeError, ValueError, LookupError) as error:  # raised by the template on these messages
            raise PowerInferError(f"chat template: {_one_line(error)}") from None


def _try_build(gguf: GGUFFile, build, *args) -> Backend:
    try:
        return build(*args)
    except Exception as error:  # the tokenizers library reports a bad vocabulary as a bare Exception
        raise ModelFileError(f"{gguf.path}: invalid tokenizer vocabulary ({_one_line(error)})") from None


def _raise_template_error(message: str):
    raise TemplateError(message)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


class StreamDecoder:
    """Turns token ids, fed one at a time, into text, never splitting a UTF-8 character.

    Byte-level and `<0xNN>` tokens can end inside a character; those bytes are held back until the
    character is complete. The pieces add up to the text of the tokens' bytes (`token_bytes`), so
    unlike `decode` a SentencePiece token keeps its leading space: generated text continues a prompt.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """The text completed by this token ("" while a character is still incomplete)."""
        return self._utf8.decode(self.tokenizer.token_bytes(token_id, special=not self.skip_special))

    def flush(self) -> str:
        """Whatever is held back at the end (an incomplete character comes out as U+FFFD)."""
        return self._utf8.decode(b"", final=True)
