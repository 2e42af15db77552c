"""The llama family: Llama 1/2/3, Mistral, SmolLM2, ReLU-Llama, Bamboo, and Mixtral-style mixtures of
experts (llama.cpp's `llama` with `expert_count`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from powerinfer.config import RMS_NORM_EPS_KEY, ArchitectureDefaults, FFNActivation, ModelConfig
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.architecture import Architecture
from powerinfer.models.base import DecoderLM
from powerinfer.models.ffn import DenseFFN, FFNOptions
from powerinfer.models.layers import Attention, Block, RMSNorm, RotaryEmbedding, attention_options, projection_builder
from powerinfer.models.moe import layer_ffn
from powerinfer.models.tensors import rms_decoder_tensors
from powerinfer.ops import native
from powerinfer.ops.linear import Int4Linear, Linear, QuantLinear, float_vector
from powerinfer.runtime.kv_cache import KVCache, SeqSpan


class LlamaBlock(Block):
    """A pre-norm block with RMSNorms and RoPE, and the native single-token step where it applies
    (kept on the CPU, with quantized projections; an offloaded block runs the same torch code as
    prefill, on whatever device holds it)."""

    def __init__(self, attn_norm: RMSNorm, attention: Attention, ffn_norm: RMSNorm, ffn):
        self._step_stale = True
        super().__init__(attn_norm, attention, ffn_norm, ffn)

    # The native step holds the block's weights: it is rebuilt when placement moves the block or
    # replaces its FFN.
    @property
    def ffn(self):
        return self._ffn

    @ffn.setter
    def ffn(self, ffn) -> None:
        self._ffn, self._step_stale = ffn, True

    def to(self, device: torch.device) -> LlamaBlock:
        super().to(device)
        self._step_stale = True
        return self

    @property
    def step(self):
        """The native step (None: the torch path), built on first use after a change."""
        if self._step_stale:
            self._step, self._step_stale = None if self.offloaded else self._native_step(), False
        return self._step

    @step.setter
    def step(self, step) -> None:  # None forces the torch path (tests compare the two)
        self._step, self._step_stale = step, False

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
        if ops is None or not (a.rope.is_plain and a.options.is_plain) or \
                not all(isinstance(p, (Int4Linear, QuantLinear)) for p in projections):
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
    """Llama blocks; subclasses change how RoPE pairs values (`ROPE_INTERLEAVED`) and which
    tensors hold Q, K and V (`qkv_names`)."""

    norm = RMSNorm
    ROPE_INTERLEAVED = True  # llama.cpp's converter permutes llama's Q and K rows for adjacent pairs

    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        self.rope = self.build_rope(gguf, config, n_ctx)
        super().__init__(gguf, config, options)

    def build_rope(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int) -> RotaryEmbedding:
        freq_factors = gguf.tensors.get("rope_freqs.weight")
        return RotaryEmbedding(config.head_dim, n_ctx, config.rope_freq_base, config.rope_scale,
                               freq_factors=float_vector(freq_factors) if freq_factors is not None else None,
                               interleaved=self.ROPE_INTERLEAVED, rope_dim=config.rope_dim)

    def qkv_names(self, i: int) -> tuple[str, ...]:
        return tuple(f"blk.{i}.{name}.weight" for name in ("attn_q", "attn_k", "attn_v"))

    def build_block(self, gguf: GGUFFile, i: int, options: FFNOptions) -> LlamaBlock:
        config = self.config
        linear = projection_builder(gguf, options.float32)
        attention = Attention(i, linear(*self.qkv_names(i)), linear(f"blk.{i}.attn_output.weight"), config.n_head,
                              config.n_head_kv, config.head_dim, self.rope, attention_options(gguf, i, config))
        return LlamaBlock(RMSNorm.load(gguf, f"blk.{i}.attn_norm", config.norm_eps), attention,
                          RMSNorm.load(gguf, f"blk.{i}.ffn_norm", config.norm_eps),
                          layer_ffn(gguf, i, config, options))

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


ARCHITECTURES = (
    # llama.cpp's `llama` is SiLU-gated; PowerInfer's sparse llamas are ReLU-Llama (ReGLU)
    Architecture(("llama",), LlamaModel, ArchitectureDefaults(RMS_NORM_EPS_KEY, FFNActivation.SILU_GATED,
                                                              FFNActivation.RELU_GATED), rms_decoder_tensors),
    Architecture(("bamboo",), LlamaModel, ArchitectureDefaults(RMS_NORM_EPS_KEY, FFNActivation.DRELU,
                                                               FFNActivation.DRELU), rms_decoder_tensors),
)
