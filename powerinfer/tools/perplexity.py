"""Perplexity the way llama.cpp's `llama-perplexity` computes it.

The text is tokenized whole and cut into chunks of n_ctx tokens; each chunk is evaluated from an
empty cache (its first token replaced by BOS when the model uses one), and only the second half of
each chunk is scored, so every scored token has at least n_ctx/2 tokens of context. The error
estimate is llama.cpp's: the standard error of the mean negative log-likelihood, times the PPL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from powerinfer.errors import PowerInferError


@dataclass
class PerplexityResult:
    chunks: int
    scored_tokens: int
    nll_sum: float
    nll2_sum: float

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.scored_tokens)

    @property
    def error(self) -> float:
        mean = self.nll_sum / self.scored_tokens
        variance = self.nll2_sum / self.scored_tokens - mean * mean
        return math.sqrt(variance / (self.scored_tokens - 1)) * self.ppl if variance > 0 and self.scored_tokens > 1 else 0.0


def chunks_of(tokens: list[int], n_ctx: int, max_chunks: int | None, bos_id: int | None) -> list[list[int]]:
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 1 or len(tokens) < 2 * n_ctx:
        raise PowerInferError(f"the text has {len(tokens)} tokens; perplexity with -c {n_ctx} needs at least {2 * n_ctx}")
    if max_chunks is not None and max_chunks > 0:
        n_chunks = min(n_chunks, max_chunks)
    chunks = [tokens[i * n_ctx : (i + 1) * n_ctx] for i in range(n_chunks)]
    if bos_id is not None:
        for chunk in chunks:
            chunk[0] = bos_id
    return chunks


def perplexity(logits_of: Callable[[list[int]], torch.Tensor], chunks: list[list[int]]) -> Iterator[PerplexityResult]:
    """Yields the running result after each chunk. `logits_of(ids)` gives [len(ids), n_vocab] logits
    evaluated from an empty cache."""
    result = PerplexityResult(0, 0, 0.0, 0.0)
    for chunk in chunks:
        n_ctx = len(chunk)
        first = n_ctx // 2
        logits = logits_of(chunk)[first : n_ctx - 1].double()
        targets = torch.tensor(chunk[first + 1 :])
        nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
        result = PerplexityResult(result.chunks + 1, result.scored_tokens + len(targets),
                                  result.nll_sum + float(nll.sum()), result.nll2_sum + float((nll * nll).sum()))
        yield result
