"""`powerinfer profile`: count FFN neuron firings over calibration text."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerinfer.commands.calibration import add_calibration_options, check_calibration_flags, load_calibration
from powerinfer.commands.parsing import OneLineParser, command_parser
from powerinfer.outputs import check_output_dir
from powerinfer.sparse.profiler import ACTIVATION_FILES, profile_activations


def build_parser() -> OneLineParser:
    parser = command_parser("profile")
    add_calibration_options(parser, output_help="output directory (gets activation/)")
    return parser


def main(args: argparse.Namespace) -> int:
    check_output_dir(Path(args.output) / "activation", ACTIVATION_FILES, args.force)
    check_calibration_flags(args)
    llm, ids = load_calibration(args)
    profile = profile_activations(llm.model, ids, args.tokens, args.chunk, args.target_sparsity, args.target_error)
    profile.save(args.output, replace=args.force)
    sparsity = profile.sparsity
    print(f"profiled {profile.tokens} tokens; mean sparsity {sum(sparsity) / len(sparsity):.1%} "
          f"(layers {min(sparsity):.1%} .. {max(sparsity):.1%}); wrote {Path(args.output) / 'activation'}", file=sys.stderr)
    return 0
