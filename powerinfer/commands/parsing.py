"""What every command's parser shares: one-line errors, llama.cpp's several-letter flags read
whole, and the types that check a flag's value before anything loads."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence

from powerinfer.commands import COMMANDS

# Several letters behind one dash, as llama.cpp spells -ngl, -cnv, -sys, -hf. argparse would read an
# unknown one as a short flag with its value glued on (-ngl 99 as -n gl), so they are refused
# unless the command defines them whole. A glued number (-n128, -t2) stays allowed.
MULTI_LETTER_FLAG = re.compile(r"-[A-Za-z][A-Za-z_-]+")


# What str.splitlines breaks a line at: a value a user typed may hold any of them (int() takes "0\r").
LINE_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag as one line on stderr and exits with status 2."""

    flags_end_at_first_word = False  # True for `powerinfer` itself: the first word names the command

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message.translate(LINE_BREAKS)} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._refuse_split_flags(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _refuse_split_flags(self, args: Sequence[str]) -> None:
        for arg in args:
            if arg == "--" or (self.flags_end_at_first_word and not arg.startswith("-")):
                return  # the rest belongs to the command's parser
            if MULTI_LETTER_FLAG.fullmatch(arg) and arg not in self._option_string_actions:
                self.error(f"unknown flag {arg} (single-dash flags are read whole, never as {arg[:2]} "
                           f"with the value {arg[2:]!r}; write '{arg[:2]} VALUE' with a space for that)")


def number(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False,
           below: bool = False) -> Callable[[str], int | float]:
    """An argparse type: `kind(text)` within [low, high] (`above`/`below`: open at that end)."""
    low_text = "" if low is None else f"{'(' if above else '['}{low:g}"
    high_text = "" if high is None else f"{high:g}{')' if below else ']'}"
    if low is not None and high is not None:
        wanted = f"in {low_text}, {high_text}"
    elif low is not None:
        wanted = f"{'>' if above else '>='} {low:g}"
    else:
        wanted = f"{'<' if below else '<='} {high:g}"

    def parse(text: str):
        value = kind(text)  # a ValueError becomes argparse's "invalid <kind> value"
        if not math.isfinite(value) or abs(value) >= 2**63:  # NaN passes every comparison below
            raise argparse.ArgumentTypeError(f"must be a finite number below 2^63, got {text}")
        ok = (low is None or (value > low if above else value >= low)) and \
             (high is None or (value < high if below else value <= high))
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


positive_int = number(int, 1)
non_negative_int = number(int, 0)
positive_float = number(float, 0, above=True)
non_negative_float = number(float, 0)
unit_interval = number(float, 0, 1, below=True)


MAX_THREADS = 4096  # torch refuses more than a C int, and no machine has more cores


def is_utf8(text: str) -> bool:
    """Whether `text` came from valid UTF-8: undecodable bytes of argv or stdin reach Python as lone
    surrogates (PEP 383), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_text(text: str) -> str:
    """An argparse type for text flags (see `is_utf8`)."""
    if not is_utf8(text):
        raise argparse.ArgumentTypeError("is not valid UTF-8 text")
    return text


utf8_text.__name__ = "text"


# llama-bench's range forms inside a list: first-last, first-last+step, first-last*factor.
INT_RANGE = re.compile(r"(?P<first>\d+)-(?P<last>\d+)(?:(?P<op>[+*])(?P<step>\d+))?")


def int_list(item: Callable[[str], int]) -> Callable[[str], list[int]]:
    """An argparse type for llama-bench's lists: `-p 128,512`, `-t 1-4`, `-p 64-512*2`, `-n 1-9+4`."""

    def expand(part: str) -> list[int]:
        found = INT_RANGE.fullmatch(part)
        if found is None:
            return [item(part)]
        first, last, op, step = int(found["first"]), int(found["last"]), found["op"] or "+", int(found["step"] or 1)
        if last < first or step < (2 if op == "*" else 1) or first == 0 and op == "*":
            raise argparse.ArgumentTypeError(f"bad range {part!r}")
        values = [first]
        while (values[-1] * step if op == "*" else values[-1] + step) <= last:
            values.append(values[-1] * step if op == "*" else values[-1] + step)
        return [item(str(v)) for v in values]

    def parse(text: str) -> list[int]:
        return [value for part in text.split(",") for value in expand(part)]

    parse.__name__ = "comma-separated list"
    return parse


def rank_list(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ranks or ranks[0] < 1:
        raise argparse.ArgumentTypeError(f"ranks must be >= 1, got {text!r}")
    return ranks


def command_parser(name: str) -> OneLineParser:
    """An empty parser for `powerinfer NAME`, described by its summary."""
    return OneLineParser(prog=f"powerinfer {name}", description=COMMANDS[name])

