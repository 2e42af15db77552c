"""llama-bench style speed tests: prompt processing (ppN) and token generation (tgN)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from powerinfer.llm import LLM


@dataclass(frozen=True)
class BenchResult:
    test: str  # "pp512", "tg128"
    tokens: int
    seconds: list[float]  # one per repetition

    @property
    def rates(self) -> list[float]:
        return [self.tokens / s for s in self.seconds]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def std(self) -> float:
        return statistics.stdev(self.rates) if len(self.rates) > 1 else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def _random_tokens(llm: LLM, n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, llm.config.n_vocab, (n,), generator=generator).tolist()


def bench_prompt(llm: LLM, n_prompt: int, repetitions: int) -> BenchResult:
    """Time evaluating `n_prompt` tokens from an empty cache (after one warm-up run)."""
    ids = _random_tokens(llm, n_prompt, seed=0)
    seconds = []
    for rep in range(repetitions + 1):
        llm.engine.release(0)
        started = time.perf_counter()
        llm.engine.prefill(0, ids)
        if rep:
            seconds.append(time.perf_counter() - started)
    return BenchResult(f"pp{n_prompt}", n_prompt, seconds)


def bench_generation(llm: LLM, n_gen: int, repetitions: int) -> BenchResult:
    """Time `n_gen` single-token decode steps from an empty cache, as llama-bench's tgN does."""
    token = _random_tokens(llm, 1, seed=1)[0]
    seconds = []
    for rep in range(repetitions + 1):
        llm.engine.release(0)
        started = time.perf_counter()
        for _ in range(n_gen):
            llm.engine.decode([(0, token)])
        if rep:
            seconds.append(time.perf_counter() - started)
    return BenchResult(f"tg{n_gen}", n_gen, seconds)


def markdown_table(llm: LLM, results: list[BenchResult], threads: int, backend: str = "CPU (torch)") -> str:
    size_mib = llm.file_size / 2**20
    bytes_per_token = llm.model.weight_bytes_per_token
    rows = [
        "| model | size | params | backend | threads | test | t/s | GB/s |",
        "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: |",
    ]
    for r in results:
        # Weights are read once per forward pass: per token when generating, per batch for prompts.
        gbps = f"{r.mean * bytes_per_token / 1e9:.1f}" if r.test.startswith("tg") else ""
        rows.append(f"| {llm.config.name} {llm.quant_label} | {size_mib:.2f} MiB | {llm.n_params / 1e6:.2f} M | {backend} "
                    f"| {threads} | {r.test} | {r.mean:.2f} ± {r.std:.2f} | {gbps} |")
    return "\n".join(rows)
