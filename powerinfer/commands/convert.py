"""`powerinfer convert`: Hugging Face folder or GGUF -> GGUF, or PowerInfer GGUF with predictors."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerinfer.commands.files import add_force_option
from powerinfer.commands.parsing import OneLineParser, command_parser
from powerinfer.convert.encode import parse_outtype
from powerinfer.convert.hf import hf_source
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.outputs import check_output_file
from powerinfer.sparse.predictor_training import load_predictors


def build_parser() -> OneLineParser:
    parser = command_parser("convert")
    parser.add_argument("source", help="Hugging Face checkpoint folder, GGUF or PowerInfer GGUF file")
    parser.add_argument("predictors", nargs="?", help="predictor directory (model_{i}.pt, config.json) -> PowerInfer GGUF")
    parser.add_argument("--outfile", required=True, help="output file")
    parser.add_argument("--outtype", help="f32, f16, q8_0, q4_0 or q4_1 (default: f16 from Hugging Face, "
                                          "the source's types from GGUF)")
    add_force_option(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    outtype = parse_outtype(args.outtype) if args.outtype else None
    check_output_file(args.outfile, args.force)
    source = hf_source(args.source) if Path(args.source).is_dir() else gguf_source(args.source)
    predictors = load_predictors(args.predictors) if args.predictors else None
    write_model(source, args.outfile, outtype, predictors, replace=args.force)
    kind = "PowerInfer GGUF" if predictors is not None or source.has_predictors else "GGUF"
    print(f"wrote {kind} {args.outfile}", file=sys.stderr)
    return 0
