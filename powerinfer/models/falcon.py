"""Falcon: the 7B layout and the new decoder architecture (40B, 180B), with GELU or ReLU
(ReLU-Falcon) FFNs. Attention and FFN read the same block input in parallel."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from powerinfer.config import ModelConfig
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.base import DecoderLM, layer_progress
from powerinfer.models.ffn import FFNOptions, build_ffn, dense_device, offload_device
from powerinfer.models.layers import Attention, Embedding, LayerNorm, RotaryEmbedding, observe_ffn, projection_builder
from powerinfer.ops.linear import CPU
from powerinfer.runtime.kv_cache import KVCache, SeqSpan


class FalconBlock:
    """x + attention(attn_norm_2(x)) + ffn(attn_norm(x)); without attn_norm_2 (7B) attention reads
    attn_norm(x) too. The predictor reads x, as in PowerInfer. Devices as in `layers.Block`."""

    def __init__(self, attn_norm: LayerNorm, attn_norm_2: LayerNorm | None, attention: Attention, ffn,
                 device: torch.device = CPU):
        self.attn_norm, self.attn_norm_2, self.attention, self.ffn = attn_norm, attn_norm_2, attention, ffn
        self.device = device
        # Called as observer(layer, residual, activations) when set (profiling, predictor training).
        self.observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def __call__(self, x: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache) -> torch.Tensor:
        x = x.to(self.device)
        h = self.attn_norm(x)
        out = x + self.attention(h if self.attn_norm_2 is None else self.attn_norm_2(x), spans, cache)
        if self.observer is not None:
            return out.add_(observe_ffn(self, h, x))
        return out.add_(self.ffn(h, x))


class FalconModel(DecoderLM):
    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        self.config = config
        if config.rope_dim != config.head_dim:
            raise UnsupportedModelError(f"{gguf.path}: partial rotary embedding is not supported for falcon")
        # NeoX-style RoPE (halves of each head paired), as llama.cpp runs Falcon: no Q/K permutation
        rope = RotaryEmbedding(config.head_dim, n_ctx, config.rope_freq_base, config.rope_scale, interleaved=False)
        self.embedding = Embedding(gguf.tensor("token_embd.weight"))
        self.blocks = [self._block(gguf, config, i, rope, options) for i in layer_progress(config.n_layers)]
        self.output_device = dense_device(options, None)
        self.output_norm = LayerNorm.load(gguf, "output_norm", config.norm_eps, self.output_device)
        self.output = projection_builder(gguf, options.float32, offload_device(options, None))(
            "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight")

    @staticmethod
    def _block(gguf: GGUFFile, config: ModelConfig, i: int, rope: RotaryEmbedding, options: FFNOptions) -> FalconBlock:
        device = dense_device(options, i)
        linear = projection_builder(gguf, options.float32, offload_device(options, i))
        # attn_qkv holds all Q heads, then all K heads, then all V heads (the converter reorders them)
        attention = Attention(i, linear(f"blk.{i}.attn_qkv.weight"), linear(f"blk.{i}.attn_output.weight"),
                              config.n_head, config.n_head_kv, config.head_dim, rope.to(device))
        norm_2 = f"blk.{i}.attn_norm_2"
        return FalconBlock(LayerNorm.load(gguf, f"blk.{i}.attn_norm", config.norm_eps, device),
                           LayerNorm.load(gguf, norm_2, config.norm_eps, device) if f"{norm_2}.weight" in gguf.tensors else None,
                           attention, build_ffn(gguf, i, config.activation, projection_builder(gguf, options.float32), options),
                           device)
