"""Model hyper-parameters, derived from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from powerinfer.errors import UnsupportedModelError
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

LLAMA_FAMILY = ("llama", "bamboo")
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + ("falcon", "opt")
OPT_POSITION_OFFSET = 2  # OPT's learned position table starts with two unused rows


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

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "ModelConfig":
        arch = gguf.require("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{gguf.path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def key(name: str, default=None):
            value = gguf.get(f"{arch}.{name}", default)
            if value is None:
                return gguf.require(f"{arch}.{name}")
            return value

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        tokens = gguf.get("tokenizer.ggml.tokens")
        n_vocab = int(gguf.get(f"{arch}.vocab_size") or (len(tokens) if tokens else gguf.tensor("token_embd.weight").shape[0]))
        n_ctx_train = int(key("context_length", 2048))
        if arch == "opt":  # PowerInfer writes 2050, the position table's rows, of which 2 are unused
            n_ctx_train = min(n_ctx_train, gguf.tensor("position_embd.weight").shape[0] - OPT_POSITION_OFFSET)
        # the llama family's RMSNorm eps, or Falcon's and OPT's LayerNorm eps
        eps_key = "attention.layer_norm_rms_epsilon" if arch in LLAMA_FAMILY else "attention.layer_norm_epsilon"
        scaling = gguf.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"{gguf.path}: unsupported RoPE scaling {scaling!r}")
        return cls(
            architecture=arch,
            name=str(gguf.get("general.name", gguf.path.stem)),
            n_layers=int(key("block_count")),
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(key("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=n_ctx_train,
            rope_dim=int(key("rope.dimension_count", head_dim)),
            rope_freq_base=float(key("rope.freq_base", 10000.0)),
            rope_scale=float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
            norm_eps=float(key(eps_key, 1e-5)),
            activation=_activation(gguf, arch),
        )


def _activation(gguf: GGUFFile, arch: str) -> FFNActivation:
    stored = gguf.get(ACTIVATION_KEY)
    if stored is not None:
        try:
            return FFNActivation(stored)
        except ValueError:
            raise UnsupportedModelError(f"{gguf.path}: unsupported FFN activation {stored!r}") from None
    if arch == "bamboo":
        return FFNActivation.DRELU
    if arch == "opt":
        return FFNActivation.RELU
    if arch == "falcon":  # PowerInfer's sparse Falcon is ReLU-Falcon; llama.cpp's Falcon is GELU
        return FFNActivation.RELU if gguf.is_powerinfer else FFNActivation.GELU
    if gguf.is_powerinfer:
        # PowerInfer's sparse llama models are ReLU-Llama (ReGLU); it never stored the activation.
        return FFNActivation.RELU_GATED
    return FFNActivation.SILU_GATED
