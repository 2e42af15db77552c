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
from powerinfer.models.layers import (
    Attention,
    AttentionOptions,
    Block,
    RMSNorm,
    RotaryEmbedding,
    attention_options,
)
from powerinfer.models.moe import layer_ffn
from powerinfer.models.tensors import rms_decoder_tensors
from powerinfer.ops import native
from powerinfer.ops.linear import BiasedLinear, float_vector
from powerinfer.options import FFNOptions
from powerinfer.runtime.kv_cache import KVCache, SeqSpan
from powerinfer.sparse.storage import projection_builder


class LlamaBlock(Block):
    """A pre-norm block with RMSNorms and RoPE (post norms too for Gemma 3), and the native
    single-token step where it applies (kept on the CPU, with quantized projections; an offloaded
    block runs the same torch code as prefill, on whatever device holds it). The native step takes
    every option of `Attention` (NeoX or partial RoPE, Q/K norms, QKV biases, windows, query
    scale, soft-capped scores) and the post norms."""

    # The native step holds the block's weights (its FFN's too, where it fuses it): it is built
    # afresh whenever the block moves or a part is replaced. Tests set `step` to None to compare the
    # torch path.
    @property
    def ffn(self):
        return self._ffn

    @ffn.setter
    def ffn(self, ffn) -> None:
        self._ffn = ffn
        self.rebuild_step()

    def rebuild_step(self) -> None:
        self.step = None if self.offloaded else self._native_step()

    def to(self, device: torch.device) -> LlamaBlock:
        super().to(device)
        self.rebuild_step()
        return self

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
                    rotations: dict[RotaryEmbedding, torch.Tensor]) -> torch.Tensor:
        """One token of each of several sequences (x [rows, d]): per row the same arithmetic as
        `decode`, with the projections batched. rotations: RoPE at the rows' positions, by RoPE
        (filled here on first use: the blocks of a step share them)."""
        if self.step is None or self.observer is not None:
            return self(x, spans, cache)
        x = x.cpu()
        layer, rope = self.attention.layer, self.attention.rope
        if rope not in rotations:
            rotations[rope] = rope.rotations[[s.start for s in spans]]
        self.step.attention_rows(x, cache.keys[layer], cache.values[layer], [s.slot for s in spans],
                                 [s.start for s in spans], rotations[rope])
        self._native_ffn(x)
        return x

    def _native_ffn(self, x: torch.Tensor) -> None:
        if self.ffn.native_projections is not None:  # the step was built with them
            self.step.dense_ffn(x)
        else:
            self.step.add_ffn_output(x, self.ffn(self.step.ffn_input(x), x))

    def _native_step(self):
        """The C++ single-token step, when the native build and this block's weights allow it."""
        ops = native.load()
        a = self.attention
        qkv, bias = (a.qkv.linear, a.qkv.bias) if isinstance(a.qkv, BiasedLinear) else (a.qkv, None)
        up, down = self.ffn.native_projections or (None, None)
        fused = self.ffn.native_projections is not None
        if ops is None or qkv.native is None or a.output.native is None or (fused and (up is None or down is None)):
            return None
        norm = lambda n: None if n is None else ops.RMSNorm(n.scaled_weight, n.eps_term)  # noqa: E731
        return ops.BlockStep(
            norm(self.attn_norm), qkv.native, a.output.native, _attention_spec(ops, a), norm(self.ffn_norm), up, down,
            native.activation(self.ffn.activation),
            ops.BlockExtras(qkv_bias=bias, qk_norm=norm(a.options.qk_norm),
                            post_attention_norm=norm(self.post_attention_norm), post_ffw_norm=norm(self.post_ffw_norm)),
        )


def _attention_spec(ops, attention: Attention):
    """What the native attention needs to know of `attention`'s RoPE and options."""
    rope, o = attention.rope, attention.options
    return ops.AttentionSpec(attention.n_head, attention.n_head_kv, rope.rope_dim, neox=not rope.interleaved,
                             window=o.window, scale=o.scale, softcap=o.softcap)


class LlamaModel(DecoderLM):
    """Llama blocks; subclasses change how RoPE pairs values (`ROPE_INTERLEAVED`), which tensors
    hold Q, K and V (`qkv_names`), which RoPE a layer uses (`layer_rope`) and whether blocks have
    post norms (`POST_NORMS`)."""

    norm = RMSNorm
    ROPE_INTERLEAVED = True  # llama.cpp's converter permutes llama's Q and K rows for adjacent pairs
    POST_NORMS = False  # post_attention_norm and post_ffw_norm in every block (Gemma 3)

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

    def layer_rope(self, options: AttentionOptions) -> RotaryEmbedding:
        """The RoPE of a layer with attention `options`."""
        return self.rope

    def build_block(self, gguf: GGUFFile, i: int, options: FFNOptions) -> LlamaBlock:
        config = self.config
        linear = projection_builder(gguf, options)
        layer_options = attention_options(gguf, i, config)
        attention = Attention(i, linear(*self.qkv_names(i)), linear(f"blk.{i}.attn_output.weight"), config.n_head,
                              config.n_head_kv, config.head_dim, self.layer_rope(layer_options), layer_options)
        norm = lambda name: RMSNorm.load(gguf, f"blk.{i}.{name}", config.norm_eps)  # noqa: E731
        post_norms = (norm("post_attention_norm"), norm("post_ffw_norm")) if self.POST_NORMS else ()
        return LlamaBlock(norm("attn_norm"), attention, norm("ffn_norm"), layer_ffn(gguf, i, config, options), *post_norms)

    def forward(self, tokens: torch.Tensor, spans: Sequence[SeqSpan], cache: KVCache,
                which: Literal["all", "last"] = "last") -> torch.Tensor:
        if any(s.length > 1 for s in spans):
            return super().forward(tokens, spans, cache, which)
        x = self.embed(tokens, spans)
        if len(spans) == 1:
            for block in self.blocks:
                x = block.decode(x, spans[0], cache)
        else:  # a decode step of several sequences
            rotations: dict[RotaryEmbedding, torch.Tensor] = {}
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
