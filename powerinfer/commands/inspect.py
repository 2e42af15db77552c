"""`powerinfer inspect`: plot activation statistics."""

from __future__ import annotations

import argparse
import sys

from powerinfer.sparsity.profiler import ActivationProfile
from powerinfer.tools.inspect_activations import plot_profile


def main(args: argparse.Namespace) -> int:
    profile = ActivationProfile.load(args.activations)
    shares = plot_profile(profile, args.output)
    print(f"wrote {args.output}; neurons covering 80% of firings: mean {sum(shares) / len(shares):.1%} "
          f"(layers {min(shares):.1%} .. {max(shares):.1%})", file=sys.stderr)
    return 0
