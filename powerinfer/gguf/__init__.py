"""GGUF and PowerInfer GGUF files: read by our bounded parser, written with the `gguf` package."""

from powerinfer.gguf.reader import GGUFFile, open_gguf

__all__ = ["GGUFFile", "open_gguf"]
