"""Checks of the Python API's arguments: a wrong type, an out-of-range id or an empty input is a
`PowerInferError` that names the argument, never a TypeError or OverflowError from deep inside."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

from powerinfer.errors import PowerInferError


def token_ids(value: Any, name: str, n_vocab: int, allow_empty: bool = True) -> list[int]:
    """`value` as a list of token ids below `n_vocab`."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not hasattr(value, "__array__"):
        raise PowerInferError(f"{name} must be a sequence of token ids, not {type(value).__name__}")
    ids = []
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, Integral):
            raise PowerInferError(f"{name}[{i}] must be an integer token id, not {type(item).__name__}")
        if not 0 <= int(item) < n_vocab:
            raise PowerInferError(f"{name}[{i}]: token id {int(item)} is out of range (vocabulary of {n_vocab})")
        ids.append(int(item))
    if not ids and not allow_empty:
        raise PowerInferError(f"{name} is empty")
    return ids


def text(value: Any, name: str) -> str:
    """`value` as text: a str, or UTF-8 bytes (as llama-cpp-python's tokenize takes them)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise PowerInferError(f"{name} is not UTF-8 text") from None
    if not isinstance(value, str):
        raise PowerInferError(f"{name} must be str or bytes, not {type(value).__name__}")
    return value


def max_tokens(value: Any, n_ctx: int) -> int:
    """llama-cpp-python's max_tokens: None or -1 runs to the end of the context."""
    if value is None or value == -1:
        return n_ctx
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
        raise PowerInferError(f"max_tokens must be an integer >= 0, or None or -1 for the rest of the context, not {value!r}")
    return int(value)
