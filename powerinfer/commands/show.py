"""`powerinfer show MODEL [--json]`: what a model file holds, read from its header."""

from __future__ import annotations

import argparse
import json

from powerinfer.commands.model_flags import add_hf_flags, model_path
from powerinfer.commands.parsing import OneLineParser, command_parser
from powerinfer.tools.show import as_text, describe


def build_parser() -> OneLineParser:
    parser = command_parser("show")
    parser.add_argument("model", nargs="?", metavar="MODEL", help="file or Hugging Face repo ORG/NAME[:QUANT] "
                                                                  "(default: the default model)")
    add_hf_flags(parser, parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(args: argparse.Namespace) -> int:
    info = describe(model_path(args))
    print(json.dumps(info, indent=2) if args.json else as_text(info))
    return 0
