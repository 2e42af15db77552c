"""Every architecture we run, in one place: each model module lists the `Architecture`s it handles
(GGUF names, defaults, tensors); this module collects them and picks one for a file."""

from __future__ import annotations

from powerinfer.config import ModelConfig
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models import falcon, gemma, llama, opt, phi3, qwen
from powerinfer.models.architecture import Architecture

ARCHITECTURES: dict[str, Architecture] = {
    name: arch for module in (llama, qwen, gemma, phi3, falcon, opt) for arch in module.ARCHITECTURES for name in arch.names
}


def architecture_of(gguf: GGUFFile) -> Architecture:
    name = gguf.require("general.architecture")
    if name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf.path}: unsupported architecture {name!r} (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def read_config(gguf: GGUFFile) -> ModelConfig:
    """The model configuration a GGUF file states, read with its architecture's defaults."""
    arch = architecture_of(gguf)
    return arch.adjust(gguf, ModelConfig.from_gguf(gguf, arch.defaults))
