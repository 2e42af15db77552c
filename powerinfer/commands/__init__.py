"""One module per CLI command (`powerinfer NAME` is `powerinfer.commands.NAME`, dashes as
underscores), each owning its flags, `build_parser()`, and `main(args) -> int`.

The summaries are here, not in the modules, so that `powerinfer --help` lists every command
without importing any (several import torch)."""

from __future__ import annotations

import importlib
from types import ModuleType

COMMANDS = {
    "run": "generate text from a prompt",
    "chat": "chat interactively using the model's chat template",
    "pull": "download a model: the default one, or a Hugging Face repo's GGUF into the HF cache",
    "show": "what a model file holds: architecture, parameters, quantization, tokenizer, chat template, "
            "sparsity (no weights loaded)",
    "bench": "measure prompt processing and generation speed (llama-bench style)",
    "serve": "HTTP server: OpenAI-compatible and llama.cpp-style routes, continuous batching",
    "perplexity": "perplexity of a text file (llama.cpp's method)",
    "profile": "count which FFN neurons fire over calibration text",
    "train-predictors": "train per-layer activation predictors (PowerInfer's format)",
    "convert": "Hugging Face folder or GGUF -> GGUF (PowerInfer GGUF with predictors)",
    "sparsify": "training-free input sparsity for every linear of a SiLU/GELU model, calibrated on a text",
    "quantize": "re-encode a (PowerInfer) GGUF's weights (Q4_0 ... Q6_K, llama.cpp's K-quant mixes)",
    "place": "solve which FFN neurons go to the accelerator for a VRAM budget",
    "inspect": "plot activation statistics (the power-law figure)",
}


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
