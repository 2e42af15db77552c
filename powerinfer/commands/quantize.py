"""`powerinfer quantize IN OUT TYPE`: re-encode a GGUF's weights, keeping its predictors usable."""

from __future__ import annotations

import argparse
import sys

from powerinfer.commands.files import add_force_option
from powerinfer.commands.parsing import OneLineParser, command_parser
from powerinfer.convert.mixes import parse_mix
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.errors import PowerInferError
from powerinfer.gguf import GGUFFile, open_gguf
from powerinfer.ops.quant import FLOAT_TYPES
from powerinfer.outputs import check_output_file


def build_parser() -> OneLineParser:
    parser = command_parser("quantize")
    parser.add_argument("input", help="GGUF or PowerInfer GGUF file")
    parser.add_argument("output", help="output file")
    parser.add_argument("type", help="Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K (every matrix that type); Q4_K_S, Q4_K_M, "
                                     "Q5_K_S, Q5_K_M (llama.cpp's mixes); POWERINFER_Q4_0 (PowerInfer's: Q4_0, "
                                     "output Q6_K, predictors Q4_0)")
    parser.add_argument("--allow-requantize", action="store_true",
                        help="also re-encode matrices that are already quantized (adds a second rounding error)")
    add_force_option(parser)
    return parser


def check_requantize(gguf: GGUFFile, allow: bool) -> None:
    """As llama-quantize: a matrix that is already quantized is only re-quantized when asked, since
    its second rounding adds to the first."""
    quantized = sorted({t.ggml_type.name for t in gguf.tensors.values() if len(t.shape) > 1 and t.ggml_type not in FLOAT_TYPES})
    if quantized and not allow:
        raise PowerInferError(f"{gguf.path} is already quantized ({', '.join(quantized)}): re-quantizing "
                              "adds a second rounding error; pass --allow-requantize to do it anyway")


def main(args: argparse.Namespace) -> int:
    mix = parse_mix(args.type)
    check_output_file(args.output, args.force)
    check_requantize(open_gguf(args.input), args.allow_requantize)
    write_model(gguf_source(args.input), args.output, mix, replace=args.force)
    print(f"wrote {args.output} ({mix.name})", file=sys.stderr)
    return 0
