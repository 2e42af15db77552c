"""What a model module declares about each GGUF architecture it runs (collected in `registry`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from powerinfer.config import ArchitectureDefaults, ModelConfig
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.base import DecoderLM
from powerinfer.models.tensors import TensorTable
from powerinfer.options import FFNOptions


def _as_stated(gguf: GGUFFile, config: ModelConfig) -> ModelConfig:
    return config


@dataclass(frozen=True)
class Architecture:
    """`names`: values of `general.architecture` it reads; `model(gguf, config, n_ctx, options)`
    builds it; `tensors(config)` lists the tensors it reads and their shapes; `adjust(gguf, config)`
    corrects what files of this architecture state wrongly (nothing by default)."""

    names: tuple[str, ...]
    model: Callable[[GGUFFile, ModelConfig, int, FFNOptions], DecoderLM]
    defaults: ArchitectureDefaults
    tensors: Callable[[ModelConfig], TensorTable]
    adjust: Callable[[GGUFFile, ModelConfig], ModelConfig] = _as_stated
