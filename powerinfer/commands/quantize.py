"""`powerinfer quantize IN OUT TYPE`: re-encode a GGUF's weights, keeping its predictors usable."""

from __future__ import annotations

import argparse
import sys

from powerinfer.convert.mixes import parse_mix
from powerinfer.convert.model import gguf_source, write_model


def main(args: argparse.Namespace) -> int:
    mix = parse_mix(args.type)
    write_model(gguf_source(args.input), args.output, mix)
    print(f"wrote {args.output} ({mix.name})", file=sys.stderr)
    return 0
