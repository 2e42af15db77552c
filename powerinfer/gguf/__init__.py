"""GGUF and PowerInfer GGUF files, read and written through the `gguf` package."""

from powerinfer.gguf.reader import GGUFFile, open_gguf

__all__ = ["GGUFFile", "open_gguf"]
