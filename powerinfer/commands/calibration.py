"""What profile and train-predictors share: their flags, the checks made before anything loads,
and the calibration text's token ids with the firing target settled."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from powerinfer.commands.files import add_force_option, read_text
from powerinfer.commands.model_flags import add_model_options, load_llm
from powerinfer.commands.parsing import positive_float, positive_int, unit_interval
from powerinfer.errors import PowerInferError

if TYPE_CHECKING:
    from powerinfer.llm import LLM

# SmolLM2 at 50 % oracle sparsity loses 2.6 % perplexity (docs/sparsity.md): a safe place to start.
DEFAULT_TARGET_SPARSITY = 0.5


def add_calibration_options(parser: argparse.ArgumentParser, output_help: str) -> None:
    """The model, the calibration text and how much of it, the firing target, and the output (-o)."""
    add_model_options(parser)
    parser.add_argument("-f", "--file", required=True, help="calibration text (e.g. wikitext-2 valid.txt; never the test text)")
    parser.add_argument("--tokens", type=positive_int, default=32768, help="calibration tokens (default: %(default)s)")
    parser.add_argument("--chunk", type=positive_int, default=512, help="tokens per forward pass (default: %(default)s)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target-sparsity", type=unit_interval,
                        help=f"SiLU/GELU models: fraction of neurons to skip (default: {DEFAULT_TARGET_SPARSITY} "
                             "unless --target-error is given)")
    target.add_argument("--target-error", type=positive_float, help="SiLU/GELU models: max mean relative FFN error")
    parser.add_argument("-o", "--output", required=True, help=output_help)
    add_force_option(parser)


def check_calibration_flags(args: argparse.Namespace) -> None:
    """What profile and train-predictors can refuse before loading anything."""
    from powerinfer.sparse.profiler import MIN_CALIBRATION_TOKENS

    if args.tokens < MIN_CALIBRATION_TOKENS:
        raise PowerInferError(f"--tokens {args.tokens}: calibration needs at least {MIN_CALIBRATION_TOKENS} tokens")


def load_calibration(args: argparse.Namespace) -> tuple[LLM, list[int]]:
    """The model, run a chunk at a time, and the calibration text's token ids (see `calibration_ids`)."""
    text = read_text(args.file)
    llm = load_llm(args, n_ctx=args.chunk, dtype="auto")
    return llm, calibration_ids(args, llm, text)


def calibration_ids(args: argparse.Namespace, llm: LLM, text: str) -> list[int]:
    """The calibration text's token ids, refused when too short, and the firing target settled:
    SiLU/GELU neurons are never exactly zero, so "fired" needs a threshold: without
    --target-sparsity or --target-error, the one half of each layer's neurons stays under."""
    from powerinfer.sparse.profiler import require_calibration_tokens

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
