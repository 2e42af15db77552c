"""OPT (pre-norm, do_layer_norm_before=True): learned position embeddings, LayerNorms, biases
everywhere, ReLU FFN (fc1, fc2)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from powerinfer.config import LAYER_NORM_EPS_KEY, ArchitectureDefaults, FFNActivation, ModelConfig
from powerinfer.errors import PowerInferError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.architecture import Architecture
from powerinfer.models.base import DecoderLM
from powerinfer.models.layers import Attention, Block, Embedding, LayerNorm
from powerinfer.models.moe import layer_ffn
from powerinfer.models.tensors import TensorTable, add_attention, add_embedding_and_head, add_ffn, add_norm
from powerinfer.options import FFNOptions
from powerinfer.runtime.kv_cache import SeqSpan
from powerinfer.sparse.storage import projection_builder

POSITION_OFFSET = 2  # OPT's learned position table starts with two unused rows


class OPTModel(DecoderLM):
    norm = LayerNorm

    def __init__(self, gguf: GGUFFile, config: ModelConfig, n_ctx: int, options: FFNOptions = FFNOptions()):
        if n_ctx > config.n_ctx_train:
            raise PowerInferError(f"n_ctx {n_ctx} exceeds the {config.n_ctx_train} positions this OPT model learned")
        self.positions = Embedding(gguf.tensor("position_embd.weight"))
        super().__init__(gguf, config, options)

    def build_block(self, gguf: GGUFFile, i: int, options: FFNOptions) -> Block:
        config = self.config
        linear = projection_builder(gguf, options)
        t = lambda name: f"blk.{i}.{name}.weight"  # noqa: E731
        attention = Attention(i, linear(t("attn_q"), t("attn_k"), t("attn_v")), linear(t("attn_output")),
                              config.n_head, config.n_head_kv, config.head_dim, rope=None)
        return Block(LayerNorm.load(gguf, f"blk.{i}.attn_norm", config.norm_eps), attention,
                     LayerNorm.load(gguf, f"blk.{i}.ffn_norm", config.norm_eps), layer_ffn(gguf, i, config, options))

    def embed(self, tokens: torch.Tensor, spans: Sequence[SeqSpan]) -> torch.Tensor:
        positions = torch.cat([torch.arange(s.start, s.end) for s in spans]) + POSITION_OFFSET
        return self.embedding(tokens) + self.positions(positions)


def opt_tensors(config: ModelConfig) -> TensorTable:
    table = TensorTable()
    add_embedding_and_head(table, config, norm_bias=True)
    table.add("position_embd.weight", (config.n_ctx_train + POSITION_OFFSET, config.n_embd))
    for i in range(config.n_layers):
        prefix = f"blk.{i}."
        add_norm(table, f"{prefix}attn_norm", config, bias=True)
        add_attention(table, prefix, config)
        add_norm(table, f"{prefix}ffn_norm", config, bias=True)
        add_ffn(table, prefix, config)
    return table


def _learned_positions(gguf: GGUFFile, config: ModelConfig) -> ModelConfig:
    """PowerInfer writes 2050 as the context length, the position table's rows, of which 2 are unused."""
    rows = gguf.tensor("position_embd.weight").shape[0]
    return dataclasses.replace(config, n_ctx_train=min(config.n_ctx_train, rows - POSITION_OFFSET))


ARCHITECTURES = (Architecture(("opt",), OPTModel, ArchitectureDefaults(
    LAYER_NORM_EPS_KEY, FFNActivation.RELU, FFNActivation.RELU), opt_tensors, _learned_positions),)
