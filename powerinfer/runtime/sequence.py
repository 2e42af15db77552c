"""One sequence being generated: sampling (constrained by a grammar if asked), end-of-generation, stop
strings, incremental text, and the log-probabilities of the tokens chosen."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from powerinfer.errors import PowerInferError
from powerinfer.runtime.sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from powerinfer.runtime.constraint import Constraint
    from powerinfer.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20


class StopTracker:
    """Knuth-Morris-Pratt over a stream for one stop string: after each character, how long the
    longest suffix of the text so far is that is a prefix of the stop. The border table is
    extended only as far as a match has reached, so a huge stop costs nothing until text matches it."""

    def __init__(self, stop: str):
        self.stop = stop
        self.borders = [0, 0]  # borders[k]: longest proper border of stop[:k]
        self.state = 0

    def _border(self, k: int) -> int:
        stop, borders = self.stop, self.borders
        while len(borders) <= k:  # amortized O(1) per entry, as in the classic table construction
            n, j = len(borders) - 1, borders[-1]
            while j and stop[j] != stop[n]:
                j = borders[j]
            borders.append(j + 1 if stop[j] == stop[n] else 0)
        return borders[k]

    def feed(self, char: str) -> bool:
        """Advance by one character; True when the stop has just been completed."""
        q, stop = self.state, self.stop
        while q and stop[q] != char:
            q = self._border(q)
        if stop[q] == char:
            q += 1
        if q == len(stop):
            self.state = self._border(q)
            return True
        self.state = q
        return False


class StopMatcher:
    """Cuts generated text at the first stop string, holding back text that may start one.

    A stop found waits while a longer stop that starts earlier may still complete. Each stop's
    tracker sees every character once, so the work is linear in the text and independent of the
    stops' lengths (copying prefixes per token made a 5 MB stop freeze the server).
    """

    def __init__(self, stops: Sequence[str]):
        self.trackers = [StopTracker(s) for s in stops if s]
        self.pending = ""  # text not shown yet; it starts at stream position `offset`
        self.offset = self.total = 0
        self.first_hit: int | None = None  # stream position of the earliest complete stop
        self.stopped = False

    def push(self, text: str) -> str:
        """Add generated text; return what is safe to show now."""
        self.pending += text
        if self.trackers:
            for char in text:
                self.total += 1
                for tracker in self.trackers:
                    if tracker.feed(char):
                        start = self.total - len(tracker.stop)
                        self.first_hit = start if self.first_hit is None else min(self.first_hit, start)
        else:
            self.total += len(text)
        open_start = min((self.total - t.state for t in self.trackers if t.state), default=self.total)
        if self.first_hit is not None and self.first_hit <= open_start:
            return self._stop_at(self.first_hit)
        # Either no stop yet, or one that a longer stop starting earlier may still overtake.
        cut = open_start - self.offset
        out, self.pending, self.offset = self.pending[:cut], self.pending[cut:], open_start
        return out

    def flush(self) -> str:
        """The text held back, at the end of generation (cut at a stop it holds)."""
        if self.first_hit is not None:
            return self._stop_at(self.first_hit)
        out, self.pending, self.offset = self.pending, "", self.total
        return out

    def _stop_at(self, position: int) -> str:
        out, self.pending, self.stopped = self.pending[: position - self.offset], "", True
        return out


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    ffn_neurons_computed: int = 0  # over the decode steps, when FFNs compute only some neurons
    ffn_neurons: int = 0  # the neurons those FFNs hold, over the same steps

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def ffn_share_skipped(self) -> float | None:
        """The share of FFN neurons the decode steps did not compute (None: no sparse FFN ran)."""
        return 1 - self.ffn_neurons_computed / self.ffn_neurons if self.ffn_neurons else None


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of its raw logits, before
    penalties, temperature and grammar), and the `top` most likely tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" (end of generation or a stop string) or "length"
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for


class GenerationSequence:
    """Turns successive next-token logits into tokens and text until it finishes.

    The caller runs the model: it feeds `accept(logits)` the logits after the last token and,
    while not `finished`, evaluates `last_token` to get the next logits. `logprobs` (None: off)
    records each token's log-probability and that many alternatives; `constraint` limits the
    tokens to a grammar, and generation ends when the grammar is complete.
    """

    def __init__(self, prompt: Sequence[int], tokenizer: Tokenizer, sampling: SamplingParams, max_tokens: int,
                 stop: Sequence[str] = (), context_left: int | None = None, logprobs: int | None = None,
                 constraint: Constraint | None = None):
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise PowerInferError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        self.prompt = list(prompt)
        self.tokenizer = tokenizer
        self.sampling, self.stops, self.context_left = sampling, list(stop), context_left
        self.sampler = Sampler(sampling)
        self.logprobs_top = logprobs
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        self.constraint = constraint
        self._logprobs_taken = 0
        self.max_tokens = max_tokens if context_left is None else min(max_tokens, context_left)
        self.generated: list[int] = []
        self.text_parts: list[str] = []
        self.decoder = tokenizer.stream_decoder()
        self.stop = StopMatcher(stop)
        self.finish_reason: str | None = None if self.max_tokens > 0 else "length"
        self.timings = Timings(prompt_tokens=len(self.prompt))

    def fork(self, seed: int | None) -> GenerationSequence:
        """Another sequence for the same prompt and settings (one of `n` choices), seeded with `seed`."""
        return GenerationSequence(self.prompt, self.tokenizer, replace(self.sampling, seed=seed), self.max_tokens,
                                  self.stops, self.context_left, self.logprobs_top,
                                  self.constraint.fork() if self.constraint is not None else None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    def accept(self, logits: torch.Tensor) -> str:
        """Sample the next token from `logits` and return the text it completes (may be '')."""
        allowed = self.constraint.allowed() if self.constraint is not None else None
        token = self.sampler(logits, self.prompt + self.generated, self.generated, allowed)
        if token in self.tokenizer.eog_ids:
            self.finish_reason = "stop"
            return self._emit(self.stop.push(self.decoder.flush()) + self.stop.flush())
        self.generated.append(token)
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.logprobs_top))
        if self.constraint is not None:
            self.constraint.advance(token)
        text = self.stop.push(self.decoder.feed(token))
        if self.stop.stopped:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_tokens or (self.constraint is not None and self.constraint.finished):
            grammar_done = self.constraint is not None and self.constraint.finished
            self.finish_reason = "stop" if grammar_done else "length"
            text += self.stop.push(self.decoder.flush())
            text += "" if self.stop.stopped else self.stop.flush()
            if self.stop.stopped:
                self.finish_reason = "stop"
        return self._emit(text)

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities recorded since the last call (for streaming them with the text)."""
        if not self.logprobs:
            return []
        new, self._logprobs_taken = self.logprobs[self._logprobs_taken :], len(self.logprobs)
        return new

    def _emit(self, text: str) -> str:
        if text:
            self.text_parts.append(text)
        return text

    def completion(self) -> Completion:
        self.timings.generated_tokens = len(self.generated)
        return Completion("".join(self.text_parts), list(self.generated), self.finish_reason or "length",
                          len(self.prompt), self.timings, None if self.logprobs is None else list(self.logprobs))
