"""Falcon: the 7B layout and the new decoder architecture (40B, 180B), with GELU or ReLU
(ReLU-Falcon) FFNs. Attention and FFN read the same block input in parallel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from powerinfer.config import LAYER_NORM_EPS_KEY, ArchitectureDefaults, FFNActivation, ModelConfig
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.architecture import Architecture
from powerinfer.models.base import DecoderLM
from powerinfer.models.layers import (
    Attention,
    DecoderBlock,
    LayerNorm,
    RotaryEmbedding,
    observe_ffn,
)
from powerinfer.models.moe import layer_ffn
from powerinfer.models.tensors import TensorTable, add_attention, add_embedding_and_head, add_ffn, add_norm
from powerinfer.options import FFNOptions
from powerinfer.runtime.kv_cache import KVCache, SeqSpan
from powerinfer.sparse.storage import projection_builder


class FalconBlock(DecoderBlock):
    """x + attention(attn_norm_2(x)) + ffn(attn_norm(x)); without attn_norm_2 (7B) attention reads
    attn_norm(x) too. The predictor reads x, as in PowerInfer."""

    DENSE_PARTS = ("attn_norm", "attn_norm_2", "attention")

    def __init__(self, attn_norm: LayerNorm, attn_norm_2: LayerNorm | None, attention: Attention, ffn):
        super().__init__(ffn)
        self.attn_norm, self.attn_norm_2, self.attention = attn_norm, attn_norm_2, attention

    def __call__(self, x: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> torch.Tensor:
        x = x.to(self.device)
        h = self.attn_norm(x)
        out = x + self.attention(h if self.attn_norm_2 is None else self.attn_norm_2(x), spans, cache)
        if self.observer is not None:
            return out.add_(observe_ffn(self, h, x))
        return out.add_(self.ffn(h, x))


class FalconModel(DecoderLM):
    norm = LayerNorm

    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        if config.rope_dim != config.head_dim:
            raise UnsupportedModelError(f"{gguf.path}: partial rotary embedding is not supported for falcon")
        # NeoX-style RoPE (halves of each head paired), as llama.cpp runs Falcon: no Q/K permutation
        self.rope = RotaryEmbedding(config.head_dim, n_ctx, config.rope_freq_base, config.rope_scale, interleaved=False)
        super().__init__(gguf, config, options)

    def build_block(self, gguf: GGUFFile, i: int, options: FFNOptions) -> FalconBlock:
        config = self.config
        linear = projection_builder(gguf, options)
        # attn_qkv holds all Q heads, then all K heads, then all V heads (the converter reorders them)
        attention = Attention(i, linear(f"blk.{i}.attn_qkv.weight"), linear(f"blk.{i}.attn_output.weight"),
                              config.n_head, config.n_head_kv, config.head_dim, self.rope)
        norm_2 = f"blk.{i}.attn_norm_2"
        return FalconBlock(LayerNorm.load(gguf, f"blk.{i}.attn_norm", config.norm_eps),
                           LayerNorm.load(gguf, norm_2, config.norm_eps) if f"{norm_2}.weight" in gguf.tensors else None,
                           attention, layer_ffn(gguf, i, config, options))


def falcon_tensors(config: ModelConfig) -> TensorTable:
    table = TensorTable()
    add_embedding_and_head(table, config, norm_bias=True)
    for i in range(config.n_layers):
        prefix = f"blk.{i}."
        add_norm(table, f"{prefix}attn_norm", config, bias=True)
        add_norm(table, f"{prefix}attn_norm_2", config, bias=True, required=False)
        add_attention(table, prefix, config, fused=True)
        add_ffn(table, prefix, config)
    return table


# llama.cpp's Falcon is GELU; PowerInfer's sparse Falcon is ReLU-Falcon
ARCHITECTURES = (Architecture(("falcon",), FalconModel, ArchitectureDefaults(
    LAYER_NORM_EPS_KEY, FFNActivation.GELU, FFNActivation.RELU), falcon_tensors),)
