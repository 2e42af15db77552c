"""`powerinfer quantize IN OUT TYPE`: re-encode a GGUF's weights, keeping its predictors usable."""

from __future__ import annotations

import argparse
import sys

from powerinfer.convert.encode import QUANTIZE_TYPES, parse_outtype
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.errors import PowerInferError
from powerinfer.outputs import check_output_file


def main(args: argparse.Namespace) -> int:
    if args.type.lower() not in QUANTIZE_TYPES:
        raise PowerInferError(f"unsupported quantization type {args.type!r} (choose from {', '.join(t.upper() for t in QUANTIZE_TYPES)})")
    check_output_file(args.output, args.force)
    source = gguf_source(args.input)
    write_model(source, args.output, parse_outtype(args.type), replace=args.force)
    print(f"wrote {args.output} ({args.type.upper()})", file=sys.stderr)
    return 0
