"""`powerinfer convert`: Hugging Face folder or GGUF -> GGUF, or PowerInfer GGUF with predictors."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerinfer.convert.encode import parse_outtype
from powerinfer.convert.hf import hf_source
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.outputs import check_output_file
from powerinfer.sparsity.predictors import load_predictors


def main(args: argparse.Namespace) -> int:
    outtype = parse_outtype(args.outtype) if args.outtype else None
    check_output_file(args.outfile, args.force)
    source = hf_source(args.source) if Path(args.source).is_dir() else gguf_source(args.source)
    predictors = load_predictors(args.predictors) if args.predictors else None
    write_model(source, args.outfile, outtype, predictors, replace=args.force)
    kind = "PowerInfer GGUF" if predictors is not None or source.has_predictors else "GGUF"
    print(f"wrote {kind} {args.outfile}", file=sys.stderr)
    return 0
