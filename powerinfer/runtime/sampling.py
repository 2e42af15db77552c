"""Token samplers: logit bias, OpenAI's presence and frequency penalties and llama.cpp's repetition
penalty, an optional mask of allowed tokens (constrained decoding), then in llama.cpp's order top-k,
top-p, min-p and temperature."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from powerinfer.errors import PowerInferError
from powerinfer.options import (
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_REPEAT_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. `temperature == 0` is greedy; 0 disables top-k / min-p."""

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    min_p: float = DEFAULT_MIN_P
    repeat_penalty: float = DEFAULT_REPEAT_PENALTY
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # added to those tokens' logits

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            (all(t >= 0 for t in self.logit_bias), "logit_bias keys must be token ids >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise PowerInferError(f"bad sampling parameter: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Draws tokens from logits; seeded samplers are reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else random.randrange(2**63))

    def __call__(self, logits: torch.Tensor, history: Sequence[int], generated: Sequence[int] = (),
                 allowed: torch.Tensor | None = None) -> int:
        """The next token after `history` (prompt and generated tokens; `generated` are the latter),
        drawn only from the `allowed` tokens (a boolean mask) when given."""
        p = self.params
        if p.logit_bias:
            logits = logits.clone()
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if (p.presence_penalty or p.frequency_penalty) and generated:
            logits = apply_openai_penalties(logits, generated, p.presence_penalty, p.frequency_penalty)
        if p.repeat_penalty != 1.0 and p.repeat_last_n > 0 and history:
            logits = apply_repeat_penalty(logits, history[-p.repeat_last_n :], p.repeat_penalty)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        if p.greedy:
            return int(torch.argmax(logits))
        candidates, ids = filter_candidates(logits, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(candidates / p.temperature, dim=-1)
        return int(ids[torch.multinomial(probs, 1, generator=self.generator)])


def apply_repeat_penalty(logits: torch.Tensor, recent: Sequence[int], penalty: float) -> torch.Tensor:
    """Make recently seen tokens less likely: positive logits divided, negative ones multiplied."""
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    seen = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def apply_openai_penalties(logits: torch.Tensor, generated: Sequence[int], presence: float,
                           frequency: float) -> torch.Tensor:
    """OpenAI's penalties: logit - presence * [seen] - frequency * count, over the generated tokens."""
    counts = Counter(generated)
    ids = torch.tensor(list(counts), dtype=torch.long)
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)
    logits = logits.clone()
    logits[ids] -= presence + frequency * n
    return logits


def filter_candidates(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits kept by top-k, top-p (nucleus) and min-p, sorted descending, with their token ids."""
    k = logits.numel() if top_k <= 0 else min(top_k, logits.numel())
    values, ids = torch.topk(logits, k)  # sorted descending
    probs = torch.softmax(values, dim=-1)
    keep = k
    if top_p < 1.0:
        # Smallest prefix whose mass reaches top_p (always at least one token).
        cumulative = torch.cumsum(probs, dim=-1)
        keep = min(keep, int(torch.searchsorted(cumulative, torch.tensor([top_p]))[0]) + 1)
    if min_p > 0.0:
        keep = min(keep, max(1, int((probs >= min_p * probs[0]).sum())))
    return values[:keep], ids[:keep]
