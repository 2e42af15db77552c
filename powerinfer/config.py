"""Model hyper-parameters, derived from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile


class FFNActivation(str, Enum):
    """How an FFN neuron's activation is computed from its gate and up projections."""

    SILU_GATED = "silu"  # silu(gate) * up: Llama, Mistral, SmolLM2, Qwen
    GELU_GATED = "gelu"  # gelu(gate) * up
    RELU_GATED = "relu"  # relu(gate) * up: ReLU-Llama / ProSparse (ReGLU)
    DRELU = "drelu"  # relu(gate) * relu(up): Bamboo, TurboSparse (dReLU)
    RELU = "relu_nogate"  # relu(up): Falcon-ReLU, OPT
    GELU = "gelu_nogate"  # gelu(up): Falcon

    @property
    def is_relu_family(self) -> bool:
        """Whether a neuron is exactly zero when it does not fire (natural sparsity)."""
        return self in (FFNActivation.RELU_GATED, FFNActivation.DRELU, FFNActivation.RELU)

    @property
    def is_gated(self) -> bool:
        return self not in (FFNActivation.RELU, FFNActivation.GELU)


# Our key for the FFN activation; llama.cpp has none and assumes SiLU for `llama`.
ACTIVATION_KEY = "powerinfer.ffn_activation"

# Names from Hugging Face `hidden_act` to the gated activation they mean in a llama-shaped model.
HF_GATED_ACTIVATIONS = {
    "silu": FFNActivation.SILU_GATED,
    "swish": FFNActivation.SILU_GATED,
    "relu": FFNActivation.RELU_GATED,
    "gelu": FFNActivation.GELU_GATED,
    "gelu_pytorch_tanh": FFNActivation.GELU_GATED,
}

RMS_NORM_EPS_KEY = "attention.layer_norm_rms_epsilon"  # RMSNorm models' eps (llama family)
LAYER_NORM_EPS_KEY = "attention.layer_norm_epsilon"  # LayerNorm models' eps (Falcon, OPT)


@dataclass(frozen=True)
class ArchitectureDefaults:
    """What a GGUF of one architecture leaves unsaid, as llama.cpp and PowerInfer read it: which key
    holds its norm's eps, and its FFN activation when the file names none (`powerinfer_activation`
    in a PowerInfer GGUF, whose sparse models are the ReLU variants)."""

    norm_eps_key: str
    activation: FFNActivation
    powerinfer_activation: FFNActivation


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rope_dim: int
    rope_freq_base: float
    rope_scale: float  # linear position scaling: positions are divided by it
    norm_eps: float
    activation: FFNActivation
    # Optional features, from llama.cpp's generic keys; the defaults are what a file without them means.
    sliding_window: int = 0  # attention.sliding_window: a query sees keys fewer than this many positions back
    swa_layers: tuple[bool, ...] = ()  # per layer, whether it uses that window (attention.sliding_window_pattern)
    rope_freq_base_swa: float = 0.0  # rope.freq_base_swa: the RoPE base of windowed layers (0: rope_freq_base)
    attention_scale: float = 0.0  # attention.scale: the query-key scale (0: 1/sqrt(head_dim))
    attn_softcap: float = 0.0  # attn_logit_softcapping: scores -> c * tanh(scores / c) (0: none)
    final_softcap: float = 0.0  # final_logit_softcapping: logits -> c * tanh(logits / c) (0: none)
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor: magnitude of the rotations (LongRoPE)
    n_ctx_orig: int = 0  # rope.scaling.original_context_length (0: n_ctx_train)
    n_expert: int = 0  # expert_count: FFN experts per layer (0: one dense FFN)
    n_expert_used: int = 0  # expert_used_count: experts each token is routed to

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_ffn_units(self) -> int:
        """The FFNs that profiling, predictors and placement see one by one: one per layer, or one
        per (layer, expert) in a mixture of experts, numbered layer by layer (`ffn_unit`)."""
        return self.n_layers * max(1, self.n_expert)

    def ffn_unit(self, layer: int, expert: int | None = None) -> int:
        return layer if expert is None else layer * self.n_expert + expert

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile, defaults: ArchitectureDefaults) -> ModelConfig:
        """The configuration a file of a known architecture states (`powerinfer.models.read_config`
        finds the architecture's defaults)."""
        arch = gguf.require("general.architecture")

        def key(name: str, default=None):
            value = gguf.get(f"{arch}.{name}", default)
            if value is None:
                return gguf.require(f"{arch}.{name}")
            return _finite_number(gguf, f"{arch}.{name}", value)

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head if n_head > 0 else 0))  # n_head checked below
        tokens = gguf.get("tokenizer.ggml.tokens")
        n_vocab = int(key("vocab_size", 0) or (len(tokens) if isinstance(tokens, list) and tokens
                                             else gguf.tensor("token_embd.weight").shape[0]))
        scaling = gguf.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"{gguf.path}: unsupported RoPE scaling {scaling!r} (supported: linear)")
        n_layers = int(key("block_count"))
        window = int(key("attention.sliding_window", 0))
        config = cls(
            architecture=arch,
            name=str(gguf.get("general.name", gguf.path.stem)),
            n_layers=n_layers,
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length", 2048)),
            rope_dim=int(key("rope.dimension_count", head_dim)),
            rope_freq_base=float(key("rope.freq_base", 10000.0)),
            rope_scale=float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
            norm_eps=float(key(defaults.norm_eps_key, 1e-5)),
            activation=_activation(gguf, defaults),
            sliding_window=window,
            swa_layers=_windowed_layers(gguf, f"{arch}.attention.sliding_window_pattern", n_layers) if window > 0 else (),
            rope_freq_base_swa=float(key("rope.freq_base_swa", 0.0)),
            attention_scale=float(key("attention.scale", 0.0)),
            attn_softcap=float(key("attn_logit_softcapping", 0.0)),
            final_softcap=float(key("final_logit_softcapping", 0.0)),
            rope_attn_factor=float(key("rope.scaling.attn_factor", 1.0)),
            n_ctx_orig=int(key("rope.scaling.original_context_length", 0)),
            n_expert=int(key("expert_count", 0)),
            n_expert_used=int(key("expert_used_count", 0)),
        )
        check_config(config, gguf)
        return config


def _windowed_layers(gguf: GGUFFile, key: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers use the sliding window, as llama.cpp reads `attention.sliding_window_pattern`: a
    list of one bool per layer, or a period n (the last layer of every n is not windowed; 0: every
    layer is). Without the key every layer is windowed (an architecture may say otherwise: `adjust`)."""
    pattern = gguf.get(key, 0)
    if isinstance(pattern, list):
        if len(pattern) != n_layers or not all(isinstance(p, bool) for p in pattern):
            raise ModelFileError(f"{gguf.path}: metadata {key} must be a number or {n_layers} booleans")
        return tuple(pattern)
    return windowed_every(int(_finite_number(gguf, key, pattern)), n_layers)


def windowed_every(period: int, n_layers: int) -> tuple[bool, ...]:
    """llama.cpp's sliding-window pattern `period`: all layers windowed but the last of every `period`."""
    return tuple(period == 0 or i % period < period - 1 for i in range(n_layers))


def _finite_number(gguf: GGUFFile, key: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelFileError(f"{gguf.path}: metadata {key} is {_short(value)}, not a finite number")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_config(config: ModelConfig, gguf: GGUFFile) -> None:
    """Refuse hyper-parameters no model can have (one line naming the first) before anything is
    sized or divided by them: a zero head count would otherwise fail at the first token with a
    traceback. (Tensor shapes are checked against the config where the model is built.)"""
    c = config
    checks = [
        (c.n_layers > 0, f"block_count {c.n_layers} must be > 0"),
        (c.n_embd > 0, f"embedding_length {c.n_embd} must be > 0"),
        (c.n_ff > 0, f"feed_forward_length {c.n_ff} must be > 0"),
        (c.n_head > 0, f"attention.head_count {c.n_head} must be > 0"),
        (c.n_head_kv > 0, f"attention.head_count_kv {c.n_head_kv} must be > 0"),
        (c.n_head_kv <= 0 or c.n_head % c.n_head_kv == 0,
         f"attention.head_count {c.n_head} is not a multiple of attention.head_count_kv {c.n_head_kv}"),
        (c.head_dim > 0, f"attention.key_length {c.head_dim} must be > 0 (or embedding_length "
                         f"{c.n_embd} a multiple of attention.head_count {c.n_head})"),
        (gguf.get(f"{c.architecture}.attention.key_length") is not None or c.n_embd == c.n_head * c.head_dim,
         f"embedding_length {c.n_embd} is not a multiple of attention.head_count {c.n_head}"),
        (0 < c.rope_dim <= c.head_dim and c.rope_dim % 2 == 0,
         f"rope.dimension_count {c.rope_dim} must be even and in 1..{c.head_dim} (the head size)"),
        (c.n_ctx_train > 0, f"context_length {c.n_ctx_train} must be > 0"),
        (c.n_vocab > 0, f"vocab_size {c.n_vocab} must be > 0"),
        (c.rope_freq_base > 0, f"rope.freq_base {c.rope_freq_base} must be > 0"),
        (c.rope_scale > 0, f"rope.scaling.factor {c.rope_scale} must be > 0"),
        (c.norm_eps > 0, f"the norm epsilon {c.norm_eps} must be > 0"),
        (c.sliding_window >= 0, f"attention.sliding_window {c.sliding_window} must be >= 0"),
        (min(c.rope_freq_base_swa, c.attention_scale, c.attn_softcap, c.final_softcap, c.n_ctx_orig) >= 0,
         "rope.freq_base_swa, attention.scale, the soft-capping values and rope.scaling.original_context_length "
         "must be >= 0"),
        (c.rope_attn_factor > 0, f"rope.scaling.attn_factor {c.rope_attn_factor} must be > 0"),
        (c.n_expert >= 0 and (c.n_expert == 0 or 0 < c.n_expert_used <= c.n_expert),
         f"expert_used_count {c.n_expert_used} must be in 1..expert_count {c.n_expert}"),
    ]
    for ok, problem in checks:
        if not ok:
            raise ModelFileError(f"{gguf.path}: invalid {c.architecture} metadata: {problem}")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if tokens is not None and (not isinstance(tokens, list) or len(tokens) != c.n_vocab):
        count = len(tokens) if isinstance(tokens, list) else "no list of"
        raise ModelFileError(f"{gguf.path}: invalid {c.architecture} metadata: vocab_size {c.n_vocab} but "
                             f"{count} tokens in tokenizer.ggml.tokens")


def _activation(gguf: GGUFFile, defaults: ArchitectureDefaults) -> FFNActivation:
    stored = gguf.get(ACTIVATION_KEY)
    if stored is None:
        return defaults.powerinfer_activation if gguf.is_powerinfer else defaults.activation
    try:
        return FFNActivation(stored)
    except ValueError:
        raise UnsupportedModelError(f"{gguf.path}: unsupported FFN activation {stored!r}") from None
