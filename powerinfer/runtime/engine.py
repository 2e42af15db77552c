"""Runs a model over KV-cache slots: prefill with prefix reuse, single and batched decode steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from powerinfer.errors import ContextOverflowError
from powerinfer.models.base import CausalLM
from powerinfer.runtime.kv_cache import CacheType, SeqSpan


class Engine:
    """A model plus its KV cache. Each slot remembers which tokens its cache holds, so a prompt
    that extends an earlier one (a chat turn, a retry) only computes the new tokens. `cache_type`:
    what the cache holds in CPU memory; by default f16, as llama.cpp's, and f32 for a model built in
    the float32 reference mode, whose arithmetic is exact."""

    def __init__(self, model: CausalLM, n_ctx: int, n_slots: int = 1, n_batch: int = 512,
                 cache_type: CacheType | None = None):
        self.model, self.n_ctx, self.n_batch = model, n_ctx, n_batch
        self.cache = model.new_cache(n_ctx, n_slots, cache_type or ("f32" if model.float32 else "f16"))
        self.slot_tokens: list[list[int]] = [[] for _ in range(n_slots)]

    @property
    def n_slots(self) -> int:
        return len(self.slot_tokens)

    def _check_fits(self, n_tokens: int) -> None:
        if n_tokens > self.n_ctx:
            raise ContextOverflowError(f"prompt of {n_tokens} tokens does not fit in the context of {self.n_ctx} tokens")

    @torch.inference_mode()
    def prefill(self, slot: int, ids: Sequence[int], reuse_prefix: bool = True) -> torch.Tensor:
        """Put `ids` in `slot` and return the logits after the last one ([n_vocab], float32).

        With `reuse_prefix`, tokens the slot already holds are not recomputed. Results then match a
        fresh evaluation only to rounding (the new tokens are batched differently), so sampling
        with a fixed seed is reproducible only without reuse.
        """
        if not ids:
            raise ContextOverflowError("empty prompt: nothing to evaluate")
        self._check_fits(len(ids))
        cached = self.slot_tokens[slot] if reuse_prefix else []
        reuse = 0
        for a, b in zip(cached, ids[:-1]):  # the last prompt token is always evaluated, for its logits
            if a != b:
                break
            reuse += 1
        self.slot_tokens[slot] = list(ids[:reuse])
        logits = None
        for start in range(reuse, len(ids), self.n_batch):
            chunk = list(ids[start : start + self.n_batch])
            logits = self.model.forward(torch.tensor(chunk), [SeqSpan(slot, start, len(chunk))], self.cache)[0]
            self.slot_tokens[slot].extend(chunk)
        return logits

    @torch.inference_mode()
    def decode(self, steps: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Append one token to each (slot, token) and return their next-token logits [len(steps), n_vocab]."""
        spans = []
        for slot, _ in steps:
            self._check_fits(len(self.slot_tokens[slot]) + 1)
            spans.append(SeqSpan(slot, len(self.slot_tokens[slot]), 1))
        logits = self.model.forward(torch.tensor([t for _, t in steps]), spans, self.cache)
        for slot, token in steps:
            self.slot_tokens[slot].append(token)
        return logits

    def copy_slot(self, source: int, target: int) -> None:
        """Make `target` hold what `source` holds (its cached tokens, keys and values)."""
        self.cache.copy_slot(source, target, len(self.slot_tokens[source]))
        self.slot_tokens[target] = list(self.slot_tokens[source])

    def all_logits(self, ids: Sequence[int], slot: int = 0, which: Literal["all", "hidden"] = "all") -> torch.Tensor:
        """Logits at every position of `ids`, evaluated from an empty slot ([len(ids), n_vocab]);
        `which="hidden"`: the final normalized hidden states instead ([len(ids), n_embd])."""
        self._check_fits(len(ids))
        self.release(slot)
        return torch.cat([self.extend(slot, ids[start : start + self.n_batch], which)
                          for start in range(0, len(ids), self.n_batch)])

    @torch.inference_mode()
    def extend(self, slot: int, ids: Sequence[int], which: Literal["all", "hidden"] = "all") -> torch.Tensor:
        """Evaluate `ids` after the tokens `slot` holds, in one forward pass; their rows (logits,
        or hidden states with `which="hidden"`). Callers bound len(ids): it is the pass's size."""
        start = len(self.slot_tokens[slot])
        self._check_fits(start + len(ids))
        rows = self.model.forward(torch.tensor(list(ids)), [SeqSpan(slot, start, len(ids))], self.cache, which)
        self.slot_tokens[slot].extend(ids)
        return rows

    def release(self, slot: int) -> None:
        self.slot_tokens[slot] = []

    def tokens_in(self, slot: int) -> int:
        return len(self.slot_tokens[slot])
