"""`powerinfer perplexity`: llama.cpp-style perplexity over a text file."""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm import tqdm

from powerinfer.commands.common import load_llm, read_text
from powerinfer.tools.perplexity import chunks_of, perplexity


def main(args: argparse.Namespace) -> int:
    text = read_text(args.file)
    args.ctx_size = args.ctx_size or 512  # llama-perplexity's default window
    llm = load_llm(args)
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
