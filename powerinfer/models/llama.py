"""The llama family: Llama 1/2/3, Mistral, SmolLM2, Qwen-style dense llamas, ReLU-Llama, Bamboo."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from powerinfer.config import ModelConfig
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.base import DecoderLM, layer_progress
from powerinfer.models.ffn import DenseFFN, FFNOptions, build_ffn, dense_device, offload_device
from powerinfer.models.layers import Attention, Block, Embedding, RMSNorm, RotaryEmbedding, projection_builder
from powerinfer.ops import native
from powerinfer.ops.linear import CPU, Int4Linear, Linear, QuantLinear, mapped_tensor
from powerinfer.runtime.kv_cache import KVCache, SeqSpan

def _norm(gguf: GGUFFile, name: str, eps: float, device: torch.device = CPU) -> RMSNorm:
    return RMSNorm(mapped_tensor(gguf.tensor(name).data).to(device), eps)


class LlamaBlock(Block):
    """A pre-norm block with RMSNorms and RoPE, and the native single-token step where it applies
    (not in offloaded blocks, which run the same torch code on whatever device holds them)."""

    def __init__(self, attn_norm: RMSNorm, attention: Attention, ffn_norm: RMSNorm, ffn,
                 offload: torch.device | None = None):
        super().__init__(attn_norm, attention, ffn_norm, ffn, CPU if offload is None else offload)
        self.step = self._native_step() if offload is None else None

    def decode(self, x: torch.Tensor, span: SeqSpan, cache: KVCache) -> torch.Tensor:
        """One token of one sequence: the block's output for x [1, d] (on the native step, x itself,
        updated in place)."""
        if self.step is None or self.observer is not None:
            return self(x, [span], cache)
        x = x.cpu()
        keys, values = cache.slot_views(self.attention.layer, span.slot)
        self.step.attention(x, keys, values, span.start, self.attention.rope.rotations[span.start])
        self._native_ffn(x)
        return x

    def decode_rows(self, x: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache,
                    rotations: torch.Tensor) -> torch.Tensor:
        """One token of each of several sequences (x [rows, d]): per row the same arithmetic as
        `decode`, with the projections batched. rotations: RoPE at each row's position."""
        if self.step is None or self.observer is not None:
            return self(x, spans, cache)
        x = x.cpu()
        layer = self.attention.layer
        self.step.attention_rows(x, cache.keys[layer], cache.values[layer], [s.slot for s in spans],
                                 [s.start for s in spans], rotations)
        self._native_ffn(x)
        return x

    def _native_ffn(self, x: torch.Tensor) -> None:
        if isinstance(self.ffn, DenseFFN):
            self.step.dense_ffn(x)
        else:
            x.add_(self.ffn(self.step.ffn_input(x), x))

    def _native_step(self):
        """The C++ single-token step, when the native build and this block's weights allow it."""
        ops = native.load()
        a = self.attention
        projections = [a.qkv, a.output] + ([self.ffn.up, self.ffn.down] if isinstance(self.ffn, DenseFFN) else [])
        if ops is None or not a.rope.interleaved or not all(isinstance(p, (Int4Linear, QuantLinear)) for p in projections):
            return None
        project = lambda p: _native_projection(ops, p)  # noqa: E731
        dense = isinstance(self.ffn, DenseFFN)
        return ops.LlamaBlockStep(
            self.attn_norm.scaled_weight, self.attn_norm.eps_term, project(a.qkv), project(a.output),
            a.n_head, a.n_head_kv, self.ffn_norm.scaled_weight, self.ffn_norm.eps_term,
            project(self.ffn.up) if dense else None, project(self.ffn.down) if dense else None,
            native.activation(self.ffn.activation),
        )


def _native_projection(ops, linear: Linear):
    """The C++ step's handle on a quantized linear layer (same kernel as its Python call)."""
    if isinstance(linear, QuantLinear):
        return linear.projection
    return ops.Int4Projection(linear.packed, linear.scale_zero, linear.out_features, linear.input_repeats)


class LlamaModel(DecoderLM):
    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        self.config = config
        if config.rope_dim != config.head_dim:
            raise UnsupportedModelError(f"{gguf.path}: partial rotary embedding is not supported for llama")
        freq_factors = gguf.tensors.get("rope_freqs.weight")
        rope = RotaryEmbedding(
            config.head_dim, n_ctx, config.rope_freq_base, config.rope_scale,
            freq_factors=mapped_tensor(freq_factors.data).float() if freq_factors is not None else None,
        )
        self.rope = rope
        self.embedding = Embedding(gguf.tensor("token_embd.weight"))
        self.blocks = [self._block(gguf, config, i, rope, options) for i in layer_progress(config.n_layers)]
        self.output_device = dense_device(options, None)
        self.output_norm = _norm(gguf, "output_norm.weight", config.norm_eps, self.output_device)
        self.output = projection_builder(gguf, options.float32, offload_device(options, None))(
            "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight")

    @staticmethod
    def _block(gguf: GGUFFile, config: ModelConfig, i: int, rope: RotaryEmbedding, options: FFNOptions) -> LlamaBlock:
        offload, device = offload_device(options, i), dense_device(options, i)
        linear = projection_builder(gguf, options.float32, offload)
        t = lambda name: f"blk.{i}.{name}.weight"  # noqa: E731
        attention = Attention(
            i, linear(t("attn_q"), t("attn_k"), t("attn_v")), linear(t("attn_output")),
            config.n_head, config.n_head_kv, config.head_dim, rope.to(device),
        )
        ffn = build_ffn(gguf, i, config.activation, projection_builder(gguf, options.float32), options)
        return LlamaBlock(_norm(gguf, f"blk.{i}.attn_norm.weight", config.norm_eps, device), attention,
                          _norm(gguf, f"blk.{i}.ffn_norm.weight", config.norm_eps, device), ffn, offload)

    def forward(self, tokens: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache,
                which: Literal["all", "last"] = "last") -> torch.Tensor:
        if any(s.length > 1 for s in spans):
            return super().forward(tokens, spans, cache, which)
        x = self.embedding(tokens)
        if len(spans) == 1:
            for block in self.blocks:
                x = block.decode(x, spans[0], cache)
        else:  # a decode step of several sequences
            rotations = self.rope.rotations[[s.start for s in spans]]  # shared by all native steps
            for block in self.blocks:
                x = block.decode_rows(x, spans, cache, rotations)
        return self.logits(x, spans, which)
