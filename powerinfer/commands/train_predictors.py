"""`powerinfer train-predictors`: learn per-layer activation predictors from calibration text."""

from __future__ import annotations

import argparse
import sys
from statistics import mean

from powerinfer.commands.common import calibration_ids, check_calibration_flags, load_llm, read_text
from powerinfer.outputs import check_output_dir
from powerinfer.sparsity.predictors import (
    PREDICTOR_FILES,
    LayerReport,
    TrainingOptions,
    save_predictors,
    train_predictors,
)
from powerinfer.sparsity.profiler import calibration_chunks, firing_thresholds


def _row(r: LayerReport) -> str:
    return (f"| {r.layer:5d} | {r.rank:4d} | {r.recall:6.4f} | {r.precision:9.4f} | {r.true_sparsity:13.1%} "
            f"| {r.predicted_sparsity:18.1%} |")


def main(args: argparse.Namespace) -> int:
    check_output_dir(args.output, PREDICTOR_FILES, args.force)
    check_calibration_flags(args)
    text = read_text(args.file)
    args.ctx_size, args.dtype = args.chunk, "auto"
    llm = load_llm(args)
    ids = calibration_ids(args, llm, text)
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
