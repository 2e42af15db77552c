"""Gemma 3: RMSNorms before and after attention and FFN, per-head Q and K norms, GELU (tanh)
gated FFN, NeoX RoPE, embeddings scaled by sqrt(n_embd), tied output head, and sliding-window
attention on most layers with a RoPE base of their own; soft-capped logits where the file says.

Norm weights are stored as llama.cpp's converter writes them: Gemma's RMSNorm multiplies by
(1 + w), and the file holds 1 + w, so they load as plain RMSNorms. These blocks run the torch path.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from powerinfer.config import RMS_NORM_EPS_KEY, ArchitectureDefaults, FFNActivation, ModelConfig, windowed_every
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.architecture import Architecture
from powerinfer.models.base import DecoderLM
from powerinfer.models.ffn import FFNOptions
from powerinfer.models.layers import (
    Attention,
    RMSNorm,
    RotaryEmbedding,
    SandwichBlock,
    attention_options,
    projection_builder,
)
from powerinfer.models.moe import layer_ffn
from powerinfer.models.tensors import rms_decoder_tensors
from powerinfer.runtime.kv_cache import SeqSpan

# What llama.cpp assumes of Gemma 3 files that do not say: windowed layers 5 of every 6, and their RoPE base
LLAMA_CPP_WINDOW_PERIOD = 6
LLAMA_CPP_LOCAL_ROPE_BASE = 10000.0
LAYERS_OF_27B = 62  # whose queries llama.cpp scales by 1/sqrt(n_embd / n_head) (its query_pre_attn_scalar)


class Gemma3Model(DecoderLM):
    norm = RMSNorm

    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        rope = partial(RotaryEmbedding, config.head_dim, n_ctx, interleaved=False, rope_dim=config.rope_dim)
        self.global_rope = rope(config.rope_freq_base, config.rope_scale)
        self.local_rope = rope(config.rope_freq_base_swa or config.rope_freq_base)  # unscaled, as in llama.cpp
        self.embed_scale = config.n_embd**0.5
        super().__init__(gguf, config, options)

    def build_block(self, gguf: GGUFFile, i: int, options: FFNOptions) -> SandwichBlock:
        c = self.config
        linear = projection_builder(gguf, options.float32)
        options_i = attention_options(gguf, i, c)
        attention = Attention(i, linear(*(f"blk.{i}.{n}.weight" for n in ("attn_q", "attn_k", "attn_v"))),
                              linear(f"blk.{i}.attn_output.weight"), c.n_head, c.n_head_kv, c.head_dim,
                              self.local_rope if options_i.window else self.global_rope, options_i)
        norm = lambda name: RMSNorm.load(gguf, f"blk.{i}.{name}", c.norm_eps)  # noqa: E731
        return SandwichBlock(norm("attn_norm"), attention, norm("post_attention_norm"), norm("ffn_norm"),
                             layer_ffn(gguf, i, c, options), norm("post_ffw_norm"))

    def embed(self, tokens: torch.Tensor, spans: list[SeqSpan]) -> torch.Tensor:
        return self.embedding(tokens).mul_(self.embed_scale)


def llama_cpp_assumptions(gguf: GGUFFile, config: ModelConfig) -> ModelConfig:
    """Gemma 3 files from llama.cpp's converter state neither the window pattern nor the windowed
    layers' RoPE base nor the query scale: llama.cpp assumes them, and so do we where the file is silent."""
    changes = {}
    if config.sliding_window and f"{config.architecture}.attention.sliding_window_pattern" not in gguf.metadata:
        changes["swa_layers"] = windowed_every(LLAMA_CPP_WINDOW_PERIOD, config.n_layers)
    if not config.rope_freq_base_swa:
        changes["rope_freq_base_swa"] = LLAMA_CPP_LOCAL_ROPE_BASE
    if not config.attention_scale:
        changes["attention_scale"] = llama_cpp_query_scale(config.n_layers, config.n_embd, config.n_head, config.head_dim)
    return dataclasses.replace(config, **changes)


def llama_cpp_query_scale(n_layers: int, n_embd: int, n_head: int, head_dim: int) -> float:
    """The query scale llama.cpp assumes for Gemma 3: 1/sqrt(n_embd / n_head) for the 27B, else 1/sqrt(head_dim)."""
    return (n_embd / n_head if n_layers == LAYERS_OF_27B else head_dim) ** -0.5


ARCHITECTURES = (Architecture(
    ("gemma3",), Gemma3Model, ArchitectureDefaults(RMS_NORM_EPS_KEY, FFNActivation.GELU_GATED, FFNActivation.GELU_GATED),
    partial(rms_decoder_tensors, head_norms=True, post_norms=True), llama_cpp_assumptions),)
