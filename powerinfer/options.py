"""Choices that the command line, the Python API and the model code share, named once here (no
imports beyond the standard library, so the command line lists them without loading torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

SparsityMode = Literal["auto", "off", "oracle"]  # predicted neurons, all of them, or the exact fired ones
SPARSITY_MODES: tuple[str, ...] = get_args(SparsityMode)
CacheType = Literal["f16", "f32"]  # what the KV cache holds in CPU memory
CACHE_TYPE_NAMES: tuple[str, ...] = get_args(CacheType)
DType = Literal["auto", "float32"]  # compact weights on our kernels, or everything dequantized
DTYPES: tuple[str, ...] = get_args(DType)

# The defaults of the choices above and of the model's sizes, for LLM and the command line alike.
DEFAULT_DTYPE: DType = "auto"
DEFAULT_SPARSITY: SparsityMode = "auto"
DEFAULT_N_BATCH = 512  # prompt tokens per forward pass, as llama.cpp's -b
DEFAULT_N_CTX = 4096  # the context when none is asked for, unless the model was trained on less


@dataclass(frozen=True)
class FFNOptions:
    """How a model's FFNs and linears are built. `thresholds`: per FFN unit |activation| thresholds
    for oracle mode (default: the file's calibrated ones; 0 for ReLU-family models)."""

    sparsity: SparsityMode = DEFAULT_SPARSITY
    float32: bool = False
    thresholds: tuple[float, ...] | None = None


def context_size(requested: int | None, n_ctx_train: int) -> int:
    """The context a model runs with: the one asked for, else DEFAULT_N_CTX capped at its training's."""
    return requested or min(DEFAULT_N_CTX, n_ctx_train)

# llama.cpp's sampling defaults: llama-cli's flags, SamplingParams' fields, and the fields of the
# server's requests that OpenAI's API does not define (OpenAI's own temperature and top_p are 1).
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
DEFAULT_REPEAT_PENALTY = 1.0  # off
DEFAULT_REPEAT_LAST_N = 64
