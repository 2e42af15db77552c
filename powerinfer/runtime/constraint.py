"""Constrained decoding: only tokens that keep the output inside a grammar may be sampled.

Built on llguidance (MIT; Rust with Python bindings, no further dependencies): it compiles JSON
schemas and Lark grammars lazily and computes the allowed-token mask for our whole vocabulary in
tens of microseconds per token. docs/serving.md says why it was chosen over xgrammar and outlines-core.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import llguidance
import numpy as np
import torch

from powerinfer.errors import PowerInferError
from powerinfer.runtime.token_bytes import token_bytes
from powerinfer.tokenizer import CONTROL, Tokenizer

# JSON on one line with json.dumps' separators: what models see most, and a small model cannot
# spin in whitespace until it runs out of tokens (flexible whitespace lets it).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(PowerInferError):
    """A schema or grammar the constraint engine cannot use."""


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids and a tokenize function."""

    def __init__(self, tokenizer: Tokenizer, eos: int):
        self.tokens = list(token_bytes(tokenizer))
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.n_vocab) if tokenizer.types[i] == CONTROL]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False)


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary (built once per model: about half a second)."""
    eog = sorted(tokenizer.eog_ids) or [tokenizer.eos_id or 0]
    wrapper = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, eog[0]))
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eog)


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON texts valid against `schema`, on one line."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
    except (ValueError, RecursionError) as error:  # llguidance refuses schemas nested 64 levels or more
        raise GrammarError(f"unusable JSON schema: {error}") from None


def lark_grammar(lark: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, RecursionError) as error:
        raise GrammarError(f"unusable grammar: {error}") from None


def regex_grammar(regex: str) -> str:
    """The grammar of texts that match `regex` whole."""
    return llguidance.LLMatcher.grammar_from_regex(regex)


class Constraint:
    """One sequence's position in a grammar: `allowed()` before sampling, `advance(token)` after."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, grammar: str):
        self.grammar, self.tokenizer, self.n_vocab = grammar, tokenizer, n_vocab
        self.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, n_vocab), grammar)
        if self.matcher.is_error():
            raise GrammarError(f"unusable grammar: {self.matcher.get_error()}")
        self._words = np.zeros((n_vocab + 31) // 32, dtype=np.int32)  # one bit per token

    def fork(self) -> Constraint:
        """The same grammar from its start, for another sequence."""
        return Constraint(self.tokenizer, self.n_vocab, self.grammar)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (only the end of generation)."""
        return self.matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """Boolean mask [n_vocab] of the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.n_vocab]
        return torch.from_numpy(bits.view(np.bool_))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is outside the grammar: {self.matcher.get_error()}")
