"""The KV cache in float16 (the default, as llama.cpp's) against float32: its memory, prefill and
decode speed at short and long contexts, on one loaded model.

    .venv/bin/python benchmarks/kv_cache_types.py [--model smollm2|gemma3-270m|PATH] [--threads 2]
        [--contexts 512 2048] [--reps 5] [--out benchmarks/results/kv_cache_types_<model>.md]

Both engines share the model's weights and run round-robin (f16, f32, f16, ...), so the machine's
noise falls on both alike; each figure is the median over `--reps` rounds. "decode at N": 32 decode
steps after a prefill of N tokens (attention reads N keys per step); "pp512": a 512-token prefill.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import get_args

import torch
from tqdm import tqdm

from powerinfer import LLM
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.kv_cache import CacheType

from common import MODEL_NAMES, benchmark_model, machine_description

DECODE_STEPS, PROMPT = 32, 512
RESULTS = Path(__file__).parent / "results"


def measure(engine: Engine, ids: list[int], contexts: list[int]) -> dict[str, float]:
    """One round on `engine`: pp512, then decode speed after each context length."""
    started = time.perf_counter()
    engine.prefill(0, ids[:PROMPT], reuse_prefix=False)
    rates = {"pp512": PROMPT / (time.perf_counter() - started)}
    for n in contexts:
        engine.prefill(0, ids[:n], reuse_prefix=False)
        started = time.perf_counter()
        for t in ids[n : n + DECODE_STEPS]:
            engine.decode([(0, t)])
        rates[f"decode at {n}"] = DECODE_STEPS / (time.perf_counter() - started)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help=f"{' or '.join(MODEL_NAMES)}, or a GGUF path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_description()
    path = benchmark_model(args.model)
    n_ctx = max(args.contexts) + DECODE_STEPS
    llm = LLM(path, n_ctx=n_ctx)
    ids = torch.randint(100, llm.config.n_vocab, (n_ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    engines = {t: Engine(llm.model, n_ctx, cache_type=t) for t in get_args(CacheType)}
    rounds: dict[str, list[dict[str, float]]] = {t: [] for t in engines}
    for _ in tqdm(range(args.reps), desc="rounds"):
        for t, engine in engines.items():
            rounds[t].append(measure(engine, ids, args.contexts))
    columns = list(rounds["f16"][0])
    medians = {t: {c: statistics.median(r[c] for r in rs) for c in columns} for t, rs in rounds.items()}
    lines = ["| cache | MiB at n_ctx " + str(n_ctx) + " | " + " | ".join(f"{c} (tok/s)" for c in columns) + " |",
             "|" + " --- |" * (2 + len(columns))]
    for t, engine in engines.items():
        lines.append(f"| {t} | {engine.cache.nbytes / 2**20:.0f} | " + " | ".join(f"{medians[t][c]:.1f}" for c in columns) + " |")
    lines.append("| f16 / f32 | " + f"{engines['f16'].cache.nbytes / engines['f32'].cache.nbytes:.2f} | "
                 + " | ".join(f"{medians['f16'][c] / medians['f32'][c]:.2f}" for c in columns) + " |")
    table = "\n".join(lines)
    print(table)
    out = args.out or RESULTS / f"kv_cache_types_{path.stem}.md"
    out.write_text(f"# KV cache: float16 (default) against float32, {path.name}\n\n"
                   f"Measured {datetime.date.today()} on {machine}; {args.threads} threads; medians of {args.reps} "
                   f"round-robin rounds; decode: {DECODE_STEPS} steps after a prefill of N tokens.\n\n{table}\n\n"
                   f"Command: `.venv/bin/python benchmarks/kv_cache_types.py --model {args.model} --threads {args.threads} "
                   f"--contexts {' '.join(map(str, args.contexts))} --reps {args.reps}`\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
