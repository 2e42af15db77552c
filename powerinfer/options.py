"""Choices that the command line, the Python API and the model code share, named once here (no
imports beyond typing, so the command line lists them without loading torch)."""

from __future__ import annotations

from typing import Literal, get_args

SparsityMode = Literal["auto", "off", "oracle"]  # predicted neurons, all of them, or the exact fired ones
SPARSITY_MODES: tuple[str, ...] = get_args(SparsityMode)
CacheType = Literal["f16", "f32"]  # what the KV cache holds in CPU memory
CACHE_TYPE_NAMES: tuple[str, ...] = get_args(CacheType)
DType = Literal["auto", "float32"]  # compact weights on our kernels, or everything dequantized
DTYPES: tuple[str, ...] = get_args(DType)
