"""`powerinfer train-predictors`: learn per-layer activation predictors from calibration text."""

from __future__ import annotations

import argparse
import sys
from statistics import mean

from powerinfer.commands.calibration import add_calibration_options, check_calibration_flags, load_calibration
from powerinfer.commands.parsing import OneLineParser, command_parser, positive_int, rank_list, unit_interval
from powerinfer.outputs import check_output_dir
from powerinfer.sparse.predictor_training import (
    PREDICTOR_FILES,
    LayerReport,
    TrainingOptions,
    save_predictors,
    train_predictors,
)
from powerinfer.sparse.profiler import calibration_chunks, firing_thresholds


def build_parser() -> OneLineParser:
    parser = command_parser("train-predictors")
    add_calibration_options(parser, output_help="predictor directory to write (model_{i}.pt, config.json)")
    parser.add_argument("--recall", type=unit_interval, default=0.99, help="recall target per layer (default: %(default)s)")
    parser.add_argument("--ranks", type=rank_list, default=(32, 64, 128, 256, 512),
                        help="candidate predictor ranks, tried from the smallest up until a larger one gains under "
                             "2 points of sparsity (default: 32,64,128,256,512)")
    parser.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps per fit (default: %(default)s)")
    return parser


def _row(r: LayerReport) -> str:
    return (f"| {r.layer:5d} | {r.rank:4d} | {r.recall:6.4f} | {r.precision:9.4f} | {r.true_sparsity:13.1%} "
            f"| {r.predicted_sparsity:18.1%} |")


def main(args: argparse.Namespace) -> int:
    check_output_dir(args.output, PREDICTOR_FILES, args.force)
    check_calibration_flags(args)
    llm, ids = load_calibration(args)
    chunks = calibration_chunks(ids, args.tokens, args.chunk)
    thresholds, _ = firing_thresholds(llm.model, chunks, args.target_sparsity, args.target_error)
    options = TrainingOptions(recall=args.recall, ranks=args.ranks, steps=args.steps)
    predictors, reports = train_predictors(llm.model, ids, thresholds, args.tokens, args.chunk, options)
    save_predictors(args.output, predictors, reports,
                    None if llm.config.activation.is_relu_family else thresholds, replace=args.force)
    print("held-out results per layer:\n"
          "| layer | rank | recall | precision | true sparsity | predicted sparsity |\n"
          "| ----: | ---: | -----: | --------: | ------------: | -----------------: |")
    for report in reports:
        print(_row(report))
    print(f"mean: recall {mean(r.recall for r in reports):.4f} (min {min(r.recall for r in reports):.4f}), "
          f"precision {mean(r.precision for r in reports):.4f}, true sparsity {mean(r.true_sparsity for r in reports):.1%}, "
          f"predicted sparsity {mean(r.predicted_sparsity for r in reports):.1%}; wrote {args.output}", file=sys.stderr)
    return 0
