"""What several commands share: finding and loading the model, reading text files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerinfer.commands.llama_flags import cache_type
from powerinfer.errors import PowerInferError
from powerinfer.hub import hf_model_path, resolve_model


def model_path(args: argparse.Namespace) -> Path:
    """The model file that -m, or -hf with --hf-file, names (fetching the default model if needed)."""
    if getattr(args, "hf_repo", None):
        return hf_model_path(args.hf_repo, args.hf_file)
    return resolve_model(args.model, getattr(args, "hf_file", None))


def load_llm(args: argparse.Namespace):
    from powerinfer.llm import LLM

    return LLM(model_path(args), threads=args.threads, n_ctx=getattr(args, "ctx_size", None), dtype=args.dtype,
               cache_type=cache_type(args), sparsity=getattr(args, "sparsity", "off"),
               **({"n_batch": args.batch_size} if args.batch_size else {}),
               chat_template=getattr(args, "chat_template", None), **hybrid_arguments(args))


def load_chat_llm(args: argparse.Namespace):
    """`load_llm` for the commands that render chats, saying in one line which template a file
    without one gets."""
    llm = load_llm(args)
    origin = llm.tokenizer.chat_template_origin
    if args.chat_template is None and origin.startswith("built-in"):
        print(f"powerinfer: {llm.path.name} has no chat template: using the {origin} template "
              "(--chat-template NAME|FILE for another)", file=sys.stderr)
    return llm


def hybrid_arguments(args: argparse.Namespace) -> dict:
    """LLM keywords from the placement flags (--vram-budget family, -ngl; absent on some commands) and
    the KV slots a server runs (--parallel), which the placement budgets for."""
    gpu_index = "reset" if getattr(args, "reset_gpu_index", False) else \
        "disable" if getattr(args, "disable_gpu_index", False) else "reuse"
    return dict(vram_budget=getattr(args, "vram_budget", None), n_gpu_layers=getattr(args, "n_gpu_layers", None) or None,
                gpu_index=gpu_index, activations=getattr(args, "activations", None),
                accelerator=getattr(args, "accelerator", None), parallel=getattr(args, "parallel", 1))


def max_tokens(n_predict: int, llm) -> int:
    return llm.n_ctx if n_predict < 0 else n_predict


def read_text(path: str) -> str:
    """A text file's contents, or one line saying why it cannot be read."""
    try:
        return Path(path).read_text()
    except IsADirectoryError:
        raise PowerInferError(f"{path} is a directory, not a text file") from None
    except UnicodeDecodeError:
        raise PowerInferError(f"{path} is not UTF-8 text") from None
    except OSError as error:
        raise PowerInferError(f"cannot read {path}: {error.strerror or error}") from None


def read_prompt(args: argparse.Namespace) -> str | None:
    """The text of -p, or of the -f file; None when neither is given."""
    return args.prompt if args.file is None else read_text(args.file)


# SmolLM2 at 50 % oracle sparsity loses 2.6 % perplexity (docs/sparsity.md): a safe place to start.
DEFAULT_TARGET_SPARSITY = 0.5


def check_calibration_flags(args: argparse.Namespace) -> None:
    """What profile and train-predictors can refuse before loading anything."""
    from powerinfer.sparsity.profiler import MIN_CALIBRATION_TOKENS

    if args.tokens < MIN_CALIBRATION_TOKENS:
        raise PowerInferError(f"--tokens {args.tokens}: calibration needs at least {MIN_CALIBRATION_TOKENS} tokens")


def calibration_ids(args: argparse.Namespace, llm, text: str) -> list[int]:
    """The calibration text's token ids, refused when too short, and the firing target settled:
    SiLU/GELU neurons are never exactly zero, so "fired" needs a threshold: without
    --target-sparsity or --target-error, the one half of each layer's neurons stays under."""
    from powerinfer.sparsity.profiler import require_calibration_tokens

    ids = llm.tokenizer.encode(text, add_bos=False)
    require_calibration_tokens(ids, args.tokens)  # before the note below: a refusal is one line
    activation = llm.config.activation
    if args.target_sparsity is None and args.target_error is None and not activation.is_relu_family:
        args.target_sparsity = DEFAULT_TARGET_SPARSITY
        print(f"powerinfer: a {activation.value} model: a neuron fires above the threshold that "
              f"{DEFAULT_TARGET_SPARSITY:.0%} of its layer's activations stay under "
              f"(--target-sparsity {DEFAULT_TARGET_SPARSITY}; --target-sparsity or --target-error to choose)",
              file=sys.stderr)
    return ids
