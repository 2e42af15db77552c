"""`powerinfer bench`: prompt-processing and generation speed, as llama-bench prints it.

Results go to stdout as each test ends (md, csv, jsonl; json at the end), progress to stderr.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from powerinfer.commands.model_flags import add_model_options, add_sparsity_options, load_llm, sparsity_settings
from powerinfer.commands.parsing import OneLineParser, command_parser, int_list, non_negative_int, positive_int
from powerinfer.errors import PowerInferError
from powerinfer.tools.bench import BenchSetup, Report, backend_name, bench_tests, run_test

DEFAULT_N_PROMPT = [512]
DEFAULT_N_GEN = [128]


def build_parser() -> OneLineParser:
    parser = command_parser("bench")
    add_model_options(parser, thread_lists=True)
    add_sparsity_options(parser)
    parser.add_argument("-p", "--n-prompt", type=int_list(non_negative_int), action="extend", metavar="N[,N...]",
                        help="prompt lengths for the pp tests (lists, ranges A-B, A-B+STEP, A-B*FACTOR); 0 = none "
                             f"(default: {','.join(map(str, DEFAULT_N_PROMPT))})")
    parser.add_argument("-n", "--n-gen", type=int_list(non_negative_int), action="extend", metavar="N[,N...]",
                        help=f"generation lengths for the tg tests; 0 = none (default: {','.join(map(str, DEFAULT_N_GEN))})")
    parser.add_argument("-r", "--repetitions", type=positive_int, default=5, help="repetitions of each test (default: %(default)s)")
    parser.add_argument("-o", "--output", choices=["md", "csv", "json", "jsonl"], default="md",
                        help="output format on stdout, with llama-bench's field names (default: %(default)s)")
    return parser


def write(text: str) -> None:
    """Results on stdout, around the progress bar on stderr when both share a terminal."""
    tqdm.write(text, file=sys.stdout, end="")
    sys.stdout.flush()


def main(args: argparse.Namespace) -> int:
    # argparse's "extend" would add to a default list, so the defaults are filled in here.
    tests = bench_tests(args.n_prompt or DEFAULT_N_PROMPT, args.n_gen or DEFAULT_N_GEN)
    if not tests:
        raise PowerInferError("nothing to measure: every -p and -n length is 0")
    n_ctx = max(t.n_prompt for t in tests) + max(t.n_gen for t in tests)
    thread_counts = args.threads or [None]
    # the model loads once, for every thread count
    llm = load_llm(args, threads=None, n_ctx=n_ctx, **sparsity_settings(args))
    report = Report(args.output, write, backend_name())
    runs = len(thread_counts) * len(tests) * (args.repetitions + 1)  # each test has one warm-up run
    with tqdm(total=runs, desc="bench", unit="run", file=sys.stderr, leave=False) as progress:
        for threads in thread_counts:
            if threads is not None:
                torch.set_num_threads(threads)
            setup = BenchSetup.of(llm, args.n_gpu_layers or 0)
            for test in tests:
                progress.set_description(f"bench {test.name} t{torch.get_num_threads()}")
                report.add(setup, run_test(llm, test, args.repetitions, after_each=lambda: progress.update()))
    report.finish()
    return 0
