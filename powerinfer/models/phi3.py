"""Phi-3 (and Phi-4-mini): llama blocks with Q, K and V in one tensor (attn_qkv) and the gate and
up rows in one (ffn_up: gate rows first), NeoX RoPE over the first rope.dimension_count values of
a head, LongRoPE frequency factors, and sliding-window attention on every layer when the file
gives a window. They decode on llama's native step, with its options."""

from __future__ import annotations

from functools import partial

from powerinfer.config import RMS_NORM_EPS_KEY, ArchitectureDefaults, FFNActivation, ModelConfig
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.architecture import Architecture
from powerinfer.models.layers import RotaryEmbedding
from powerinfer.models.llama import LlamaModel
from powerinfer.models.tensors import rms_decoder_tensors
from powerinfer.ops.linear import float_vector


class Phi3Model(LlamaModel):
    ROPE_INTERLEAVED = False

    def build_rope(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int) -> RotaryEmbedding:
        """LongRoPE as llama.cpp applies it: the long factors when the context exceeds the one the
        model was trained with, the short ones otherwise, and the rotations scaled by attn_factor."""
        long, short = (gguf.tensors.get(f"rope_factors_{kind}.weight") for kind in ("long", "short"))
        factors = long if n_ctx > (config.n_ctx_orig or config.n_ctx_train) else short
        return RotaryEmbedding(config.head_dim, n_ctx, config.rope_freq_base, config.rope_scale,
                               freq_factors=None if factors is None else float_vector(factors), interleaved=False,
                               rope_dim=config.rope_dim, attn_factor=config.rope_attn_factor)

    def qkv_names(self, i: int) -> tuple[str, ...]:
        return (f"blk.{i}.attn_qkv.weight",)


ARCHITECTURES = (Architecture(
    ("phi3",), Phi3Model, ArchitectureDefaults(RMS_NORM_EPS_KEY, FFNActivation.SILU_GATED, FFNActivation.RELU_GATED),
    partial(rms_decoder_tensors, fused=True)),)
