"""Architectures behind one contract (`CausalLM`), chosen from GGUF metadata."""

from __future__ import annotations

import ctypes

from powerinfer.config import LLAMA_FAMILY, ModelConfig
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.base import CausalLM
from powerinfer.models.ffn import FFNOptions
from powerinfer.ops.quant import SUPPORTED_TYPES


def check_tensor_types(gguf: GGUFFile) -> None:
    for tensor in gguf.tensors.values():
        if tensor.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(f"{gguf.path}: unsupported tensor type {tensor.ggml_type.name} ({tensor.name})")


def load_model(gguf: GGUFFile, n_ctx: int, options: FFNOptions = FFNOptions()) -> CausalLM:
    """Build the model a GGUF file describes (`options`: sparsity mode, float32 reference mode)."""
    config = ModelConfig.from_gguf(gguf)
    check_tensor_types(gguf)
    if config.architecture in LLAMA_FAMILY:
        from powerinfer.models.llama import LlamaModel

        model = LlamaModel(gguf, config, n_ctx, options)
    elif config.architecture == "falcon":
        from powerinfer.models.falcon import FalconModel

        model = FalconModel(gguf, config, n_ctx, options)
    elif config.architecture == "opt":
        from powerinfer.models.opt import OPTModel

        model = OPTModel(gguf, config, n_ctx, options)
    else:  # pragma: no cover - from_gguf already rejects these
        raise UnsupportedModelError(f"unsupported architecture {config.architecture}")
    gguf.release_pages()
    release_freed_memory()
    return model


def release_freed_memory() -> None:
    """Give the heap freed by weight repacking back to the OS (glibc keeps large freed blocks)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
