"""The flags that name and load a model, and the `LLM` keywords read from them.

Every command that loads a model takes `add_model_options`; the context and sparsity flags are
groups of their own, taken by the commands they mean something to, and each group's reader
(`sparsity_settings`) sits beside it. `load_llm` reads the common flags and takes the rest as
keywords from the command, so no flag is looked for on a command that lacks it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from powerinfer.commands.llama_flags import add_model_flags, cache_type
from powerinfer.commands.parsing import (
    MAX_THREADS,
    int_list,
    non_negative_float,
    non_negative_int,
    number,
    positive_int,
)
from powerinfer.hub import hf_model_path, resolve_model
from powerinfer.options import CACHE_TYPE_NAMES, DEFAULT_DTYPE, DEFAULT_N_CTX, DEFAULT_SPARSITY, DTYPES, SPARSITY_MODES

if TYPE_CHECKING:
    from powerinfer.llm import LLM


def add_model_source(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """-m PATH or REPO, -hf REPO[:QUANT], --hf-file FILE."""
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("-m", "--model", help="GGUF or PowerInfer GGUF file, or a Hugging Face repo ORG/NAME[:QUANT] "
                        "(default: SmolLM2-135M-Instruct Q4_1, fetched on first use)")
    add_hf_flags(source, parser)


def add_hf_flags(repo_group: argparse._ActionsContainer, parser: argparse.ArgumentParser) -> None:
    """-hf REPO[:QUANT] (into `repo_group`) and --hf-file FILE."""
    repo_group.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", metavar="ORG/NAME[:QUANT]",
                            help="Hugging Face repo, through the local Hugging Face cache (works offline once cached); "
                                 "QUANT picks the .gguf whose name contains it (default Q4_K_M, else the only .gguf)")
    parser.add_argument("-hff", "--hf-file", metavar="FILE", help="file in the Hugging Face repo (overrides :QUANT)")


def add_model_options(parser: argparse.ArgumentParser, thread_lists: bool = False) -> None:
    """What every command that loads a model takes: its source, threads, weights and KV cache types,
    and llama.cpp's model flags."""
    add_model_source(parser)
    if thread_lists:  # bench: one run of the tests per count, as llama-bench's -t 1,2
        parser.add_argument("-t", "--threads", type=int_list(number(int, 1, MAX_THREADS)), action="extend",
                            metavar="N[,N...]",
                            help="CPU thread counts to measure with (default: torch's choice, the physical cores)")
    else:
        parser.add_argument("-t", "--threads", type=number(int, 1, MAX_THREADS),
                            help="CPU threads (default: torch's choice, the physical cores)")
    parser.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=non_negative_int, metavar="N",
                        help="layers to offload to the GPU, as in llama.cpp (without a CUDA device: everything runs on the CPU)")
    parser.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                        help="auto: compact weights on fast kernels; float32: dequantize everything (exact, slow) "
                             "(default: %(default)s)")
    parser.add_argument("-ctk", "--cache-type", choices=CACHE_TYPE_NAMES,
                        help="KV cache type in CPU memory (default: f16, as llama.cpp; f32 with --dtype float32)")
    add_model_flags(parser)


def add_context_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--ctx-size", type=positive_int,
                        help=f"context size in tokens (default: min({DEFAULT_N_CTX}, training context))")


def add_sparsity_options(parser: argparse.ArgumentParser) -> None:
    """--sparsity, and where the FFN neurons go (PowerInfer's hybrid CPU/accelerator split)."""
    parser.add_argument("--sparsity", choices=SPARSITY_MODES, default=DEFAULT_SPARSITY,
                        help="auto: compute only the FFN neurons the file's predictors expect to fire (dense without "
                             "predictors); off: dense; oracle: skip exactly the neurons that do not fire (verification) "
                             "(default: %(default)s)")
    parser.add_argument("--vram-budget", type=non_negative_float, metavar="GB",
                        help="accelerator memory in GiB: dense parts (attention, output head) go there first, then the "
                             "hottest FFN neurons (default: CPU only)")
    parser.add_argument("--activations", metavar="DIR", help="activation statistics for placing neurons "
                        "(default: activation/ next to the model, else all neurons alike)")
    index = parser.add_mutually_exclusive_group()
    index.add_argument("--reset-gpu-index", action="store_true", help="rebuild <model>.generated.gpuidx")
    index.add_argument("--disable-gpu-index", action="store_true", help="no neuron split: ignore the GPU index, offload dense parts only")
    parser.add_argument("--accelerator", metavar="DEVICE",
                        help="torch device to offload to (default: cuda when present; cpu runs the split on the CPU)")


def sparsity_settings(args: argparse.Namespace) -> dict[str, Any]:
    """LLM keywords from `add_sparsity_options`' flags."""
    gpu_index = "reset" if args.reset_gpu_index else "disable" if args.disable_gpu_index else "reuse"
    return dict(sparsity=args.sparsity, vram_budget=args.vram_budget, gpu_index=gpu_index,
                activations=args.activations, accelerator=args.accelerator)


def model_path(args: argparse.Namespace) -> Path:
    """The model file that -m, or -hf with --hf-file, names (fetching the default model if needed)."""
    if args.hf_repo:
        return hf_model_path(args.hf_repo, args.hf_file)
    return resolve_model(args.model, args.hf_file)


def llm_settings(args: argparse.Namespace, **settings: Any) -> dict[str, Any]:
    """LLM's keywords: the model file and `add_model_options`' flags, then `settings` (the
    command's other flags, or its own choices), which win."""
    return dict(model=model_path(args), threads=args.threads, dtype=args.dtype, cache_type=cache_type(args),
                n_batch=args.batch_size, n_gpu_layers=args.n_gpu_layers or None) | settings


def load_llm(args: argparse.Namespace, **settings: Any) -> LLM:
    from powerinfer.llm import LLM

    return LLM(**llm_settings(args, **settings))
