"""Architectures behind one contract (`CausalLM`), chosen from GGUF metadata by the registry.

Models are built on the CPU and know nothing of accelerators: `powerinfer.placement` moves parts
of a finished model to one.
"""

from __future__ import annotations

import ctypes

from powerinfer.config import ModelConfig
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.base import CausalLM, DecoderLM
from powerinfer.models.registry import architecture_of, read_config
from powerinfer.ops.quant import SUPPORTED_TYPES
from powerinfer.options import FFNOptions

__all__ = ["CausalLM", "DecoderLM", "FFNOptions", "load_model", "read_config"]


def check_tensor_types(gguf: GGUFFile) -> None:
    for tensor in gguf.tensors.values():
        if tensor.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(f"{gguf.path}: unsupported tensor type {tensor.ggml_type.name} ({tensor.name})")


def load_model(gguf: GGUFFile, n_ctx: int, options: FFNOptions = FFNOptions(),
               config: ModelConfig | None = None) -> DecoderLM:
    """Build the model a GGUF file describes, on the CPU (`options`: sparsity mode, float32
    reference mode), after checking every tensor it reads against its configuration (`config`:
    the one read from this file before, when its metadata has since been dropped)."""
    arch = architecture_of(gguf)
    config = config or read_config(gguf)
    check_tensor_types(gguf)
    arch.tensors(config).check(gguf)
    model = arch.model(gguf, config, n_ctx, options)
    gguf.release_pages()
    release_freed_memory()
    return model


def release_freed_memory() -> None:
    """Give the heap freed by weight repacking back to the OS (glibc keeps large freed blocks)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
