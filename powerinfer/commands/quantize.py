"""`powerinfer quantize IN OUT TYPE`: re-encode a GGUF's weights, keeping its predictors usable."""

from __future__ import annotations

import argparse
import sys

from powerinfer.convert.mixes import parse_mix
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.errors import PowerInferError
from powerinfer.gguf import GGUFFile, open_gguf
from powerinfer.ops.quant import FLOAT_TYPES
from powerinfer.outputs import check_output_file


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
