"""The bytes each vocabulary entry stands for, which the `tokenizers` library does not expose:
byte-level BPE spells bytes as printable characters (GPT-2's table), SentencePiece spells spaces
as "▁" and has byte tokens "<0xNN>". Logprobs report these bytes, and constrained decoding matches
grammars against them."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import decoders

from powerinfer.tokenizer import BYTE, CONTROL, Tokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte: printable Latin-1 bytes stand for
    themselves, the others map to 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


@lru_cache(maxsize=8)
def token_bytes(tokenizer: Tokenizer) -> tuple[bytes, ...]:
    """Bytes of every token id; control tokens (e.g. "<|im_end|>") give their text."""
    pieces = [tokenizer.piece(i) or "" for i in range(tokenizer.n_vocab)]
    if isinstance(tokenizer.backend.decoder, decoders.ByteLevel):
        alphabet = _byte_level_alphabet()

        def to_bytes(piece: str) -> bytes:
            return bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else piece.encode()
    else:
        def to_bytes(piece: str) -> bytes:
            return piece.replace("▁", " ").encode()

    out = []
    for i, piece in enumerate(pieces):
        kind = tokenizer.types[i]
        if kind == CONTROL:
            out.append(piece.encode())
        elif kind == BYTE and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(to_bytes(piece))
    return tuple(out)
