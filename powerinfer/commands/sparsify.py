"""`powerinfer sparsify -m MODEL -f CALIB.txt -o OUT.gguf`: training-free input sparsity (TEAL-style)
for every linear of every block, calibrated on a text (powerinfer/sparse/sparsify.py)."""

from __future__ import annotations

import argparse
import sys

from powerinfer.commands.files import add_force_option, read_text
from powerinfer.commands.model_flags import add_model_source, model_path
from powerinfer.commands.parsing import MAX_THREADS, OneLineParser, command_parser, number, positive_int, unit_interval
from powerinfer.gguf import open_gguf
from powerinfer.llm import LLM
from powerinfer.outputs import check_output_file
from powerinfer.sparse.allocate import METHODS
from powerinfer.sparse.calibrate import DEFAULT_TOKENS
from powerinfer.sparse.sparsify import DEFAULT_MAX_PPL_INCREASE, Target, sparsify
from powerinfer.sparse.storage import sparse_sites


def build_parser() -> OneLineParser:
    parser = command_parser("sparsify")
    add_model_source(parser)
    parser.add_argument("-t", "--threads", type=number(int, 1, MAX_THREADS),
                        help="CPU threads (default: torch's choice, the physical cores)")
    parser.add_argument("-f", "--file", required=True, help="calibration text (e.g. wikitext-2 valid.txt; never the test text)")
    parser.add_argument("--tokens", type=positive_int, default=DEFAULT_TOKENS,
                        help="calibration tokens (default: %(default)s)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target-sparsity", type=unit_interval,
                        help="fraction of the weights to skip per token, spread across layers and projections, at the "
                             "sites (block linears, output head) whose skipping pays on this CPU (every site with --all-sites)")
    target.add_argument("--max-ppl-increase", type=number(float, 1), metavar="FACTOR",
                        help="the most sparsity whose perplexity on the calibration text stays within FACTOR times the "
                             f"dense model's (default: {DEFAULT_MAX_PPL_INCREASE} unless --target-sparsity is given)")
    parser.add_argument("--allocation", choices=METHODS, default="measured",
                        help="how the target is spread: measured (whichever of blockwise and uniform gives the calibration "
                             "text the lower perplexity), uniform (every site alike, TEAL's baseline), blockwise (TEAL's "
                             "greedy per block), global (one greedy across the model) (default: %(default)s)")
    parser.add_argument("--all-sites", action="store_true",
                        help="give every site that skips channels its thresholds, even where this CPU measured the "
                             "dense rows faster (a file for another machine; by default such sites run dense)")
    parser.add_argument("-o", "--output", required=True, help="the sparsified GGUF")
    add_force_option(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    check_output_file(args.output, args.force)
    text = read_text(args.file)
    llm = LLM(model_path(args), threads=args.threads, sparsity="off")  # calibrated dense
    allocation = sparsify(llm, text, args.output, Target(args.target_sparsity, args.max_ppl_increase), args.force,
                          args.tokens, args.allocation, all_sites=args.all_sites)
    where = "every site that skips" if args.all_sites else "the sites whose skipping pays on this CPU"
    skipping = sparse_sites(open_gguf(args.output))  # the allocation's sites less those that run dense here
    print(f"wrote {args.output}: {allocation.sparsity_at(skipping):.1%} of the linears' weights (blocks and output head) skipped per "
          f"token on the calibration text, at {where} ({allocation.criterion} thresholds, {allocation.method} "
          "allocation)", file=sys.stderr)
    return 0
