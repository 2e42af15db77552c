"""`powerinfer bench`: prompt-processing and generation speed, as llama-bench prints it.

Results go to stdout as each test ends (md, csv, jsonl; json at the end), progress to stderr.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from powerinfer.commands.common import load_llm
from powerinfer.errors import PowerInferError
from powerinfer.tools.bench import BenchSetup, Report, backend_name, bench_tests, run_test

DEFAULT_N_PROMPT = [512]
DEFAULT_N_GEN = [128]


def write(text: str) -> None:
    """Results on stdout, around the progress bar on stderr when both share a terminal."""
    tqdm.write(text, file=sys.stdout, end="")
    sys.stdout.flush()


def main(args: argparse.Namespace) -> int:
    # argparse's "extend" would add to a default list, so the defaults are filled in here.
    tests = bench_tests(args.n_prompt or DEFAULT_N_PROMPT, args.n_gen or DEFAULT_N_GEN)
    if not tests:
        raise PowerInferError("nothing to measure: every -p and -n length is 0")
    args.ctx_size = max(t.n_prompt for t in tests) + max(t.n_gen for t in tests)
    thread_counts, args.threads = args.threads or [None], None  # the model loads once, for every count
    llm = load_llm(args)
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
