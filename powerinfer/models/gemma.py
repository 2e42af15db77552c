"""Gemma 3: RMSNorms before and after attention and FFN, per-head Q and K norms, GELU (tanh)
gated FFN, NeoX RoPE, embeddings scaled by sqrt(n_embd), tied output head, and sliding-window
attention on most layers with a RoPE base of their own; soft-capped logits where the file says.

Norm weights are stored as llama.cpp's converter writes them: Gemma's RMSNorm multiplies by
(1 + w), and the file holds 1 + w, so they load as plain RMSNorms. The blocks are llama's with post
norms, so they decode on the native step.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from powerinfer.config import RMS_NORM_EPS_KEY, ArchitectureDefaults, FFNActivation, ModelConfig, windowed_every
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.architecture import Architecture
from powerinfer.models.layers import AttentionOptions, RotaryEmbedding
from powerinfer.models.llama import LlamaModel
from powerinfer.models.tensors import rms_decoder_tensors
from powerinfer.options import FFNOptions
from powerinfer.runtime.kv_cache import SeqSpan

# What llama.cpp assumes of Gemma 3 files that do not say: windowed layers 5 of every 6, and their RoPE base
LLAMA_CPP_WINDOW_PERIOD = 6
LLAMA_CPP_LOCAL_ROPE_BASE = 10000.0
LAYERS_OF_27B = 62  # whose queries llama.cpp scales by 1/sqrt(n_embd / n_head) (its query_pre_attn_scalar)


class Gemma3Model(LlamaModel):
    ROPE_INTERLEAVED = False
    POST_NORMS = True

    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        # the windowed layers' RoPE: their own base, unscaled, as in llama.cpp (the others: `self.rope`)
        self.local_rope = RotaryEmbedding(config.head_dim, n_ctx, config.rope_freq_base_swa or config.rope_freq_base,
                                          interleaved=False, rope_dim=config.rope_dim)
        self.embed_scale = config.n_embd**0.5
        super().__init__(gguf, config, n_ctx, options)

    def layer_rope(self, options: AttentionOptions) -> RotaryEmbedding:
        return self.local_rope if options.window else self.rope

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
