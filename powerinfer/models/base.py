"""The contract every architecture implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from tqdm import tqdm

from powerinfer.config import ModelConfig
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.layers import DecoderBlock, Embedding, LayerNorm, RMSNorm
from powerinfer.ops.linear import CPU, Linear
from powerinfer.options import FFNOptions
from powerinfer.runtime.kv_cache import CacheType, KVCache, SeqSpan
from powerinfer.sparse.storage import projection_builder

Which = Literal["all", "last", "hidden"]


class CausalLM(ABC):
    """A decoder-only language model over compact GGUF weights.

    `forward` takes the tokens of one or more sequences concatenated (one span per sequence, in
    order), stores their keys and values in the cache, and returns float32 logits: for every
    token (`which="all"`) or for the last token of each span (`which="last"`); `which="hidden"`
    returns every token's final normalized hidden state instead (for embeddings).
    """

    config: ModelConfig
    float32: bool = False  # built in the float32 reference mode (FFNOptions.float32): exact arithmetic

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache, which: Which = "last"
    ) -> torch.Tensor: ...

    @property
    @abstractmethod
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read to decode one token (for bandwidth figures)."""

    def new_cache(self, n_ctx: int, n_slots: int, cache_type: CacheType) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, n_slots, c.n_head_kv, n_ctx, c.head_dim, self.cache_devices, cache_type)

    @property
    def cache_devices(self) -> list[torch.device] | None:
        """Where each layer's keys and values live (None: all on the CPU)."""
        return None


def layer_progress(n_layers: int) -> Iterable[int]:
    """range(n_layers), with a progress bar while loading (only on a terminal)."""
    return tqdm(range(n_layers), desc="loading", unit="layer", leave=False, disable=None)


@dataclass(frozen=True)
class FFNUnit:
    """One FFN as profiling, predictor training and placement see it: block `layer`'s FFN, or its
    expert `expert` in a mixture of experts; `index` numbers units as `ModelConfig.ffn_unit` does."""

    index: int
    layer: int
    block: DecoderBlock
    expert: int | None = None

    @property
    def ffn(self):
        return self.block.ffn if self.expert is None else self.block.ffn.experts[self.expert]

    def replace(self, ffn) -> None:
        """Put `ffn` in this unit's place (placement's hybrid or dense form of it)."""
        if self.expert is None:
            self.block.ffn = ffn
        else:
            experts = list(self.block.ffn.experts)
            experts[self.expert] = ffn
            self.block.ffn = self.block.ffn.with_experts(experts)


class DecoderLM(CausalLM):
    """What every architecture shares: the token `embedding`, `blocks` (`DecoderBlock`s, called as
    block(x, spans, cache)), the final norm and the output head: `output.weight`, or the token
    embedding where the file ties them. Subclasses say how their norms load (`norm`) and build
    their blocks (`build_block`). x moves to each block's device as it goes; logits come back to
    the CPU."""

    norm: ClassVar[type[RMSNorm] | type[LayerNorm]]

    def __init__(self, gguf: GGUFFile, config: ModelConfig, options: FFNOptions):
        self.config, self.float32 = config, options.float32
        self.embedding = Embedding(gguf.tensor("token_embd.weight"))
        self.blocks: list[DecoderBlock] = []
        for i in layer_progress(config.n_layers):
            self.blocks.append(self.build_block(gguf, i, options))
            gguf.release_pages()  # the block holds its own copies: the file's pages would double the peak memory
        self.output_norm = self.norm.load(gguf, "output_norm", config.norm_eps)
        tied = "output.weight" not in gguf.tensors
        self.output: Linear = projection_builder(gguf, options)("token_embd.weight" if tied else "output.weight")
        self.output_device = CPU

    @abstractmethod
    def build_block(self, gguf: GGUFFile, layer: int, options: FFNOptions) -> DecoderBlock: ...

    def output_to(self, device: torch.device) -> None:
        """Move the final norm and the output head to `device`."""
        self.output_norm, self.output, self.output_device = self.output_norm.to(device), self.output.to(device), device

    @property
    def cache_devices(self) -> list[torch.device]:
        return [block.device for block in self.blocks]

    def ffn_units(self) -> list[FFNUnit]:
        """Every FFN unit, in unit order: each block's FFN, or each expert of each block."""
        c = self.config
        if not c.n_expert:
            return [FFNUnit(i, i, block) for i, block in enumerate(self.blocks)]
        return [FFNUnit(c.ffn_unit(i, e), i, block, e) for i, block in enumerate(self.blocks) for e in range(c.n_expert)]

    def embed(self, tokens: torch.Tensor, spans: Sequence[SeqSpan]) -> torch.Tensor:
        return self.embedding(tokens)

    def forward(self, tokens: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache,
                which: Which = "last") -> torch.Tensor:
        x = self.embed(tokens, spans)
        for block in self.blocks:
            x = block(x, spans, cache)
        return self.logits(x, spans, which)

    def logits(self, x: torch.Tensor, spans: Sequence[SeqSpan], which: Which) -> torch.Tensor:
        """float32 logits from the last block's output x (all rows, or each span's last row), or
        with "hidden" the normalized rows themselves."""
        if which == "last" and x.shape[0] > len(spans):
            ends = torch.cumsum(torch.tensor([s.length for s in spans]), 0)
            x = x[ends.to(x.device) - 1]
        hidden = self.output_norm(x.to(self.output_device))
        if which == "hidden":
            return hidden.float().cpu()
        logits = self.output(hidden).float()
        if self.config.final_softcap:  # Gemma's soft cap on the logits
            cap = self.config.final_softcap
            logits = torch.tanh(logits.div_(cap)).mul_(cap)
        return logits.cpu()

    @property
    def weight_bytes_per_token(self) -> int:
        return sum(b.attention.nbytes + b.ffn.nbytes for b in self.blocks) + self.output.nbytes
