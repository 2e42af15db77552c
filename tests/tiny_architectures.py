"""Tiny random transformers models of each architecture beyond the llama family, made the same way
for every test that needs them (tests/test_architectures.py, tests/test_moe.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 256
N_CTX = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=N_CTX, initializer_range=0.1, tie_word_embeddings=False)
# Gemma 3: six layers for llama.cpp's pattern (five windowed, one global), 270M's head shape
GEMMA = dict(SMALL, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
             query_pre_attn_scalar=256, sliding_window=8, tie_word_embeddings=True)
MOE = dict(SMALL, num_local_experts=4, num_experts_per_tok=2)
PHI = dict(SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                original_max_position_embeddings=32, short_factor=[1.0 + 0.1 * i for i in range(6)],
                long_factor=[2.0 + 0.5 * i for i in range(6)])


@dataclass(frozen=True)
class Case:
    make: Callable[[], PreTrainedModel]
    llamacpp: bool = True  # tests/llamacpp_gguf.py writes it (llama.cpp's converter takes such a model)
    readback: bool = False  # transformers reads llama.cpp-convention GGUFs of the architecture
    window: int = 0  # sliding window: the decode test runs past it


CASES = {
    "qwen2": Case(lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)), readback=True),
    # head_dim is not hidden_size / heads; transformers' GGUF reader takes Qwen3Config's default (128)
    "qwen3": Case(lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=128)), readback=True),
    "gemma3": Case(lambda: Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA)), readback=True, window=GEMMA["sliding_window"]),
    # what llama.cpp's converter leaves to assumption, stated by ours: the windowed layers, their RoPE
    # base and the query scale; and soft-capped logits
    "gemma3-stated": Case(lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **dict(GEMMA, num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=24), final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 5000.0}})),
        llamacpp=False, window=GEMMA["sliding_window"]),
    "phi3": Case(lambda: Phi3ForCausalLM(Phi3Config(**PHI)), readback=True),
    # Phi-4-mini's partial rotary embedding, Phi-3-128k's LongRoPE (the prompt runs past the trained
    # context: long factors) and Phi-3's sliding window
    "phi3-longrope": Case(lambda: Phi3ForCausalLM(Phi3Config(
        **PHI, rope_parameters=LONGROPE, original_max_position_embeddings=LONGROPE["original_max_position_embeddings"],
        sliding_window=12)), window=12),
    "mixtral": Case(lambda: MixtralForCausalLM(MixtralConfig(**MOE))),
    # ReGLU experts: skipping the neurons that output zero changes nothing (sparse paths exact);
    # llama.cpp's llama has no key for the activation
    "mixtral-relu": Case(lambda: MixtralForCausalLM(MixtralConfig(**MOE, hidden_act="relu")), llamacpp=False),
}


def make(name: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model = CASES[name].make().eval()
    with torch.no_grad():  # transformers starts norms at 1 (Gemma's at 0) and biases at 0, which would hide bugs
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model
