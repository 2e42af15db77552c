"""`powerinfer bench`: prompt-processing and generation speed as a markdown table."""

from __future__ import annotations

import argparse

import torch

from powerinfer.commands.common import load_llm
from powerinfer.tools.bench import bench_generation, bench_prompt, markdown_table


def main(args: argparse.Namespace) -> int:
    args.ctx_size = args.n_prompt + args.n_gen
    llm = load_llm(args)
    results = [bench_prompt(llm, args.n_prompt, args.repetitions), bench_generation(llm, args.n_gen, args.repetitions)]
    print(markdown_table(llm, results, torch.get_num_threads()))
    return 0
