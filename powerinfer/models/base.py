"""The contract every architecture implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal

import torch

from powerinfer.config import ModelConfig
from powerinfer.runtime.kv_cache import KVCache, SeqSpan


class CausalLM(ABC):
    """A decoder-only language model over compact GGUF weights.

    `forward` takes the tokens of one or more sequences concatenated (one span per sequence, in
    order), stores their keys and values in the cache, and returns float32 logits: for every
    token (`which="all"`) or for the last token of each span (`which="last"`).
    """

    config: ModelConfig

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache, which: Literal["all", "last"] = "last"
    ) -> torch.Tensor: ...

    @property
    @abstractmethod
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read to decode one token (for bandwidth figures)."""

    def new_cache(self, n_ctx: int, n_slots: int = 1) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, n_slots, c.n_head_kv, n_ctx, c.head_dim)
