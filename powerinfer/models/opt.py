"""OPT (pre-norm, do_layer_norm_before=True): learned position embeddings, LayerNorms, biases
everywhere, ReLU FFN (fc1, fc2)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from powerinfer.config import OPT_POSITION_OFFSET, ModelConfig
from powerinfer.errors import PowerInferError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.base import DecoderLM, layer_progress
from powerinfer.models.ffn import FFNOptions, build_ffn, dense_device, offload_device
from powerinfer.models.layers import Attention, Block, Embedding, LayerNorm, projection_builder
from powerinfer.runtime.kv_cache import SeqSpan


class OPTModel(DecoderLM):
    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        self.config = config
        if n_ctx > config.n_ctx_train:
            raise PowerInferError(f"n_ctx {n_ctx} exceeds the {config.n_ctx_train} positions this OPT model learned")
        self.embedding = Embedding(gguf.tensor("token_embd.weight"))
        self.positions = Embedding(gguf.tensor("position_embd.weight"))
        self.blocks = [self._block(gguf, config, i, options) for i in layer_progress(config.n_layers)]
        self.output_device = dense_device(options, None)
        self.output_norm = LayerNorm.load(gguf, "output_norm", config.norm_eps, self.output_device)
        self.output = projection_builder(gguf, options.float32, offload_device(options, None))(
            "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight")

    @staticmethod
    def _block(gguf: GGUFFile, config: ModelConfig, i: int, options: FFNOptions) -> Block:
        device = dense_device(options, i)
        linear = projection_builder(gguf, options.float32, offload_device(options, i))
        t = lambda name: f"blk.{i}.{name}.weight"  # noqa: E731
        attention = Attention(i, linear(t("attn_q"), t("attn_k"), t("attn_v")), linear(t("attn_output")),
                              config.n_head, config.n_head_kv, config.head_dim, rope=None)
        return Block(LayerNorm.load(gguf, f"blk.{i}.attn_norm", config.norm_eps, device), attention,
                     LayerNorm.load(gguf, f"blk.{i}.ffn_norm", config.norm_eps, device),
                     build_ffn(gguf, i, config.activation, projection_builder(gguf, options.float32), options), device)

    def embed(self, tokens: torch.Tensor, spans: Sequence[SeqSpan]) -> torch.Tensor:
        positions = torch.cat([torch.arange(s.start, s.end) for s in spans]) + OPT_POSITION_OFFSET
        return self.embedding(tokens) + self.positions(positions)
