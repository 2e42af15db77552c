"""`powerinfer pull [ORG/NAME[:QUANT]]`: fetch the default model, or a Hugging Face repo's GGUF."""

from __future__ import annotations

import argparse

from powerinfer.commands.model_flags import add_hf_flags
from powerinfer.commands.parsing import OneLineParser, command_parser
from powerinfer.errors import PowerInferError
from powerinfer.hub import hf_model_path, pull_default_model


def build_parser() -> OneLineParser:
    parser = command_parser("pull")
    parser.add_argument("repo", nargs="?", metavar="ORG/NAME[:QUANT]", help="Hugging Face repo (default: the default model)")
    add_hf_flags(parser, parser)
    return parser


def main(args: argparse.Namespace) -> int:
    if args.repo and args.hf_repo:
        raise PowerInferError("name the repo once: as the argument or with -hf, not both")
    repo = args.repo or args.hf_repo
    if repo is None:
        if args.hf_file:
            raise PowerInferError("--hf-file needs a Hugging Face repo (ORG/NAME)")
        print(pull_default_model())
    else:
        print(hf_model_path(repo, args.hf_file, refresh=True))
    return 0
