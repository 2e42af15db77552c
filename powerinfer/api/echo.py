"""/v1/completions' `echo`: the prompt comes back before the completion, and with `logprobs` the
prompt's own tokens are scored too (what lm-evaluation-harness's loglikelihood tasks read, with
`max_tokens: 0`). The first token has nothing before it: its logprob is null, as OpenAI's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from powerinfer.runtime.sequence import TokenLogprob, token_logprob

if TYPE_CHECKING:
    from powerinfer.llm import LLM


@dataclass
class Echo:
    text: str  # the prompt as the client sent it (token ids: their text)
    ids: list[int]
    top: int | None  # top logprobs asked for (None: no logprobs)
    logprobs: list[TokenLogprob | None] | None = None  # once `score` ran

    def score(self, llm: LLM) -> None:
        """Score the prompt's tokens (a forward pass over it: run where the model's thread is)."""
        if self.top is None:
            return
        logits = torch.from_numpy(llm.logits(self.ids))
        self.logprobs = [None] + [token_logprob(logits[i - 1], self.ids[i], self.top) for i in range(1, len(self.ids))]
