"""`powerinfer inspect`: plot activation statistics."""

from __future__ import annotations

import argparse
import sys

from powerinfer.commands.files import add_force_option
from powerinfer.commands.parsing import OneLineParser, command_parser
from powerinfer.outputs import check_output_file
from powerinfer.sparse.profiler import ActivationProfile
from powerinfer.tools.inspect_activations import image_format, plot_profile


def build_parser() -> OneLineParser:
    parser = command_parser("inspect")
    parser.add_argument("--activations", required=True, help="profile directory (with activation/)")
    parser.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf, ...)")
    add_force_option(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    check_output_file(args.output, args.force)
    image_format(args.output)
    profile = ActivationProfile.load(args.activations)
    shares = plot_profile(profile, args.output, replace=args.force)
    print(f"wrote {args.output}; neurons covering 80% of firings: mean {sum(shares) / len(shares):.1%} "
          f"(layers {min(shares):.1%} .. {max(shares):.1%})", file=sys.stderr)
    return 0
