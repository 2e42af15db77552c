"""`powerinfer profile`: count FFN neuron firings over calibration text."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerinfer.commands.common import calibration_ids, check_calibration_flags, load_llm, read_text
from powerinfer.outputs import check_output_dir
from powerinfer.sparsity.profiler import ACTIVATION_FILES, profile_activations


def main(args: argparse.Namespace) -> int:
    check_output_dir(Path(args.output) / "activation", ACTIVATION_FILES, args.force)
    check_calibration_flags(args)
    text = read_text(args.file)
    args.ctx_size, args.dtype = args.chunk, "auto"
    llm = load_llm(args)
    ids = calibration_ids(args, llm, text)
    profile = profile_activations(llm.model, ids, args.tokens, args.chunk, args.target_sparsity, args.target_error)
    profile.save(args.output, replace=args.force)
    sparsity = profile.sparsity
    print(f"profiled {profile.tokens} tokens; mean sparsity {sum(sparsity) / len(sparsity):.1%} "
          f"(layers {min(sparsity):.1%} .. {max(sparsity):.1%}); wrote {Path(args.output) / 'activation'}", file=sys.stderr)
    return 0
