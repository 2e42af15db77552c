"""`powerinfer perplexity`: llama.cpp-style perplexity over a text file."""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm

from powerinfer.commands.files import read_text
from powerinfer.commands.model_flags import (
    add_context_option,
    add_model_options,
    add_sparsity_options,
    load_llm,
    sparsity_settings,
)
from powerinfer.commands.parsing import OneLineParser, command_parser, positive_int
from powerinfer.tools.perplexity import chunks_of, perplexity

LLAMA_PERPLEXITY_CTX = 512  # llama-perplexity's default window


def build_parser() -> OneLineParser:
    parser = command_parser("perplexity")
    add_model_options(parser)
    add_context_option(parser)
    add_sparsity_options(parser)
    parser.add_argument("-f", "--file", required=True, help="text file (e.g. wikitext-2 test.txt)")
    parser.add_argument("--chunks", type=positive_int, help="evaluate at most this many chunks (default: all)")
    return parser


def main(args: argparse.Namespace) -> int:
    text = read_text(args.file)
    llm = load_llm(args, n_ctx=args.ctx_size or LLAMA_PERPLEXITY_CTX, **sparsity_settings(args))
    tokens = llm.tokenizer.encode(text, add_bos=True)
    bos = llm.tokenizer.bos_id if llm.tokenizer.add_bos else None
    chunks = chunks_of(tokens, llm.n_ctx, args.chunks, bos)
    print(f"perplexity: {len(tokens)} tokens, {len(chunks)} chunks of {llm.n_ctx}", file=sys.stderr)
    logits_of = lambda ids: torch.from_numpy(llm.logits(ids))  # noqa: E731
    # On one terminal a progress bar would redraw over the values printed on its line; there, as
    # llama-perplexity does, one line gives the time per chunk and the time left instead.
    shared_terminal = sys.stdout.isatty() and sys.stderr.isatty()
    started, result = time.perf_counter(), None
    for result in tqdm(perplexity(logits_of, chunks), total=len(chunks), desc="perplexity", unit="chunk",
                       file=sys.stderr, disable=shared_terminal):
        if shared_terminal and result.chunks == 1:
            seconds = time.perf_counter() - started
            print(f"perplexity: {seconds:.2f} seconds per chunk - ETA {seconds * (len(chunks) - 1) / 60:.2f} minutes",
                  file=sys.stderr, flush=True)
        print(f"[{result.chunks}]{result.ppl:.4f},", end="", flush=True)
    print()
    print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.error:.5f}")
    return 0
