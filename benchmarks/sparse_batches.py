"""Batched decode (several sequences per step, as `serve --parallel` runs them) on a sparsified file
against its dense source.

    .venv/bin/python benchmarks/sparse_batches.py --sparse-model FILE [--model smollm2] [--rows 1 2 4 8]
        [--threads 2] [--n-gen 32] [--reps 7] [--out FILE]

`--sparse-model` is what `powerinfer sparsify` wrote from `--model` (default: the default SmolLM2).
Per batch size R: R slots each hold a different wikitext-2 valid prompt; then `--n-gen` greedy
decode steps of all R sequences at once (`Engine.decode`, one forward pass of R rows per step).
tok/s counts every sequence's tokens. Files and batch sizes are interleaved, each repetition on
freshly filled slots; medians of `--reps`. A sparsified file's linears read the union of the
batch's selected channels once per step (sparse_input.h), so their saving shrinks as R grows.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch

from common import benchmark_model, interleaved, machine_description, memory_read_rate, paired_ratio, wikitext

PROMPT_TOKENS = 64


def prompts(llm, count: int) -> list[list[int]]:
    """`count` different prompts of PROMPT_TOKENS tokens from wikitext-2 valid."""
    ids = llm.tokenize(wikitext("valid.txt")[:200_000])
    return [ids[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(count)]


def batch_rate(engine, batch: list[list[int]], n_gen: int) -> float:
    """Tokens per second of `n_gen` greedy steps of all of `batch`'s sequences at once."""
    for slot, prompt in enumerate(batch):
        engine.release(slot)
        engine.prefill(slot, prompt, reuse_prefix=False)
    tokens = [prompt[-1] for prompt in batch]
    started = time.perf_counter()
    for _ in range(n_gen):
        logits = engine.decode(list(enumerate(tokens)))
        tokens = [int(t) for t in logits.argmax(dim=-1)]
    return len(batch) * n_gen / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the dense source: smollm2, gemma3-270m or a GGUF path")
    parser.add_argument("--sparse-model", required=True, type=Path, help="the file `powerinfer sparsify` wrote from it")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="sequences per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-gen", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from powerinfer import LLM

    machine, memory_before = machine_description(), memory_read_rate()
    dense_path = benchmark_model(args.model)
    files = {"dense": dense_path, "sparse": args.sparse_model}
    llms = {name: LLM(str(path), threads=args.threads, parallel=max(args.rows)) for name, path in files.items()}
    engines = {name: llm.new_engine(max(args.rows)) for name, llm in llms.items()}
    batch = prompts(llms["dense"], max(args.rows))
    rates: dict[tuple[str, int], list[float]] = {(name, r): [] for name in files for r in args.rows}
    with torch.inference_mode():
        for name in files:  # warm-up
            batch_rate(engines[name], batch[:1], 4)
        for rep in range(args.reps):
            for r in args.rows:
                for name in interleaved(list(files), rep):
                    rates[name, r].append(batch_rate(engines[name], batch[:r], args.n_gen))
            print(f"repetition {rep + 1}/{args.reps} done", flush=True)
    lines = [
        "# Batched decode: a sparsified file against its dense source",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine}; {args.threads} threads; load average "
        f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} at the end; memory read {memory_before} at the start, "
        f"{memory_read_rate()} at the end.",
        "",
        f"Dense: `{dense_path.name}`; sparse: `{args.sparse_model.name}` ({llms['sparse'].sparsity}). "
        f"{args.n_gen} greedy steps of R sequences at once after {PROMPT_TOKENS}-token prompts; tok/s counts "
        f"every sequence; medians of {args.reps} interleaved repetitions (ABBA order); sparse / dense: the median "
        "of each repetition's ratio to the dense run beside it, and those ratios' quartiles.",
        "",
        "| sequences per step | dense tok/s | sparse tok/s | sparse / dense | quartiles |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in args.rows:
        dense, sparse = statistics.median(rates["dense", r]), statistics.median(rates["sparse", r])
        ratio, low, high = paired_ratio(rates["sparse", r], rates["dense", r])
        lines.append(f"| {r} | {dense:.1f} | {sparse:.1f} | {ratio:.2f}x | {low:.2f}-{high:.2f} |")
    lines += ["", f"Command: `.venv/bin/python benchmarks/sparse_batches.py --sparse-model FILE"
                  f"{f' --model {args.model}' if args.model else ''} --rows {' '.join(map(str, args.rows))} "
                  f"--threads {args.threads} --n-gen {args.n_gen} --reps {args.reps}`"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
