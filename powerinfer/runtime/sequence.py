"""One sequence being generated: sampling, end-of-generation, stop strings, incremental text."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from powerinfer.runtime.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from powerinfer.tokenizer import Tokenizer


class StopMatcher:
    """Cuts generated text at the first stop string, holding back text that may start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add generated text; return what is safe to show now."""
        self.pending += text
        first, open_start = self._first_stop(), self._open_start()
        if first is not None and first <= open_start:
            return self._stop_at(first)
        # Either no stop yet, or one that a longer stop starting earlier may still overtake.
        out, self.pending = self.pending[:open_start], self.pending[open_start:]
        return out

    def flush(self) -> str:
        """The text held back, at the end of generation (cut at a stop it holds)."""
        first = self._first_stop()
        if first is not None:
            return self._stop_at(first)
        out, self.pending = self.pending, ""
        return out

    def _first_stop(self) -> int | None:
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _open_start(self) -> int:
        """Where the earliest stop that more text could still complete would begin (the end of the
        pending text when none could)."""
        return min((len(self.pending) - n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])),
                   default=len(self.pending))

    def _stop_at(self, index: int) -> str:
        out, self.pending, self.stopped = self.pending[:index], "", True
        return out


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (end of generation or a stop string) or "length"
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


class GenerationSequence:
    """Turns successive next-token logits into tokens and text until it finishes.

    The caller runs the model: it feeds `accept(logits)` the logits after the last token and,
    while not `finished`, evaluates `last_token` to get the next logits.
    """

    def __init__(self, prompt: Sequence[int], tokenizer: Tokenizer, sampling: SamplingParams, max_tokens: int,
                 stop: Sequence[str] = (), context_left: int | None = None):
        self.prompt = list(prompt)
        self.tokenizer = tokenizer
        self.sampler = Sampler(sampling)
        self.max_tokens = max_tokens if context_left is None else min(max_tokens, context_left)
        self.length_limited_by_context = context_left is not None and context_left < max_tokens
        self.generated: list[int] = []
        self.text_parts: list[str] = []
        self.decoder = tokenizer.stream_decoder()
        self.stop = StopMatcher(stop)
        self.finish_reason: str | None = None if self.max_tokens > 0 else "length"
        self.timings = Timings(prompt_tokens=len(self.prompt))
        self._started = time.perf_counter()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    def accept(self, logits: torch.Tensor) -> str:
        """Sample the next token from `logits` and return the text it completes (may be '')."""
        token = self.sampler(logits, self.prompt + self.generated)
        if token in self.tokenizer.eog_ids:
            self.finish_reason = "stop"
            return self._emit(self.stop.push(self.decoder.flush()) + self.stop.flush())
        self.generated.append(token)
        text = self.stop.push(self.decoder.feed(token))
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_tokens:
            self.finish_reason = "length"
            text += self.stop.push(self.decoder.flush())
            text += "" if self.stop.stopped else self.stop.flush()
            if self.stop.stopped:
                self.finish_reason = "stop"
        return self._emit(text)

    def _emit(self, text: str) -> str:
        if text:
            self.text_parts.append(text)
        return text

    def completion(self) -> Completion:
        self.timings.generated_tokens = len(self.generated)
        return Completion("".join(self.text_parts), list(self.generated), self.finish_reason or "length",
                          len(self.prompt), self.timings)
