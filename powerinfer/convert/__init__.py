"""Converters: Hugging Face checkpoints and GGUF files to GGUF / PowerInfer GGUF."""
