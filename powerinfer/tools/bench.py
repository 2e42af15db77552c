"""llama-bench style speed tests: prompt processing (ppN) and token generation (tgN).

Results print as llama-bench prints them: a markdown table, or CSV/JSON/JSONL records with
llama-bench's field names (n_prompt, n_gen, avg_ns, avg_ts, stddev_ts, samples_ts, ...), so that
scripts written for llama-bench's output read ours.
"""

from __future__ import annotations

import csv
import io
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch

from powerinfer.build_info import commit
from powerinfer.llm import LLM
from powerinfer.ops import native


@dataclass(frozen=True)
class BenchTest:
    n_prompt: int
    n_gen: int

    @property
    def name(self) -> str:
        return f"pp{self.n_prompt}" if self.n_prompt else f"tg{self.n_gen}"

    @property
    def tokens(self) -> int:
        return self.n_prompt + self.n_gen


@dataclass(frozen=True)
class BenchResult:
    test: BenchTest
    seconds: list[float]  # one per repetition
    started: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def rates(self) -> list[float]:
        return [self.test.tokens / s for s in self.seconds]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def std(self) -> float:
        return statistics.stdev(self.rates) if len(self.rates) > 1 else 0.0


def bench_tests(n_prompt: list[int], n_gen: list[int]) -> list[BenchTest]:
    """llama-bench's order: the pp tests, then the tg tests; a length of 0 is no test."""
    return [BenchTest(p, 0) for p in n_prompt if p] + [BenchTest(0, n) for n in n_gen if n]


def _random_tokens(llm: LLM, n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, llm.config.n_vocab, (n,), generator=generator).tolist()


def _time_prompt(llm: LLM, n_prompt: int) -> Callable[[], None]:
    """Evaluating `n_prompt` tokens from an empty cache."""
    ids = _random_tokens(llm, n_prompt, seed=0)

    def run() -> None:
        llm.engine.release(0)
        llm.engine.prefill(0, ids)

    return run


def _time_generation(llm: LLM, n_gen: int) -> Callable[[], None]:
    """`n_gen` single-token decode steps from an empty cache, as llama-bench's tgN does."""
    token = _random_tokens(llm, 1, seed=1)[0]

    def run() -> None:
        llm.engine.release(0)
        for _ in range(n_gen):
            llm.engine.decode([(0, token)])

    return run


def run_test(llm: LLM, test: BenchTest, repetitions: int, after_each: Callable[[], None] = lambda: None) -> BenchResult:
    """Time `test` `repetitions` times after one untimed warm-up run; `after_each` follows every run."""
    step = _time_prompt(llm, test.n_prompt) if test.n_prompt else _time_generation(llm, test.n_gen)
    started = datetime.now(UTC)
    seconds = []
    for rep in range(repetitions + 1):
        begin = time.perf_counter()
        step()
        if rep:
            seconds.append(time.perf_counter() - begin)
        after_each()
    return BenchResult(test, seconds, started)


@dataclass(frozen=True)
class BenchSetup:
    """What llama-bench reports about the model and the machine beside each result."""

    model_filename: str
    model_type: str  # llama-bench: "<arch> <size> <type>"
    model_size: int  # bytes
    model_n_params: int
    n_threads: int
    n_gpu_layers: int
    weight_bytes_per_token: int
    sparsity: str  # ours: off, predictors or oracle (llama-bench has no such field)

    @classmethod
    def of(cls, llm: LLM, n_gpu_layers: int) -> BenchSetup:
        return cls(str(llm.path), f"{llm.config.name} {llm.quant_label}", llm.file_size, llm.n_params,
                   torch.get_num_threads(), n_gpu_layers, llm.model.weight_bytes_per_token, llm.sparsity)


def backend_name() -> str:
    """What ran the kernels: the native instruction set (avx512, avx2+vnni, avx2, scalar), else plain torch."""
    return "CPU (torch)" if native.load() is None else f"CPU ({native.kernels_label()})"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def record(setup: BenchSetup, result: BenchResult, backend: str) -> dict:
    """One llama-bench JSON record (its field names; the fields that describe llama.cpp's own
    backends and options are left out)."""
    samples_ns = [round(s * 1e9) for s in result.seconds]
    return {
        "build_commit": commit(),
        "cpu_info": _cpu_name(),
        "gpu_info": torch.cuda.get_device_name() if torch.cuda.is_available() else "",
        "backends": backend,
        "model_filename": setup.model_filename,
        "model_type": setup.model_type,
        "model_size": setup.model_size,
        "model_n_params": setup.model_n_params,
        "n_threads": setup.n_threads,
        "n_gpu_layers": setup.n_gpu_layers,
        "sparsity": setup.sparsity,
        "n_prompt": result.test.n_prompt,
        "n_gen": result.test.n_gen,
        "n_depth": 0,
        "test_time": result.started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "avg_ns": round(statistics.fmean(samples_ns)),
        "stddev_ns": round(statistics.stdev(samples_ns)) if len(samples_ns) > 1 else 0,
        "avg_ts": result.mean,
        "stddev_ts": result.std,
        "samples_ns": samples_ns,
        "samples_ts": result.rates,
    }


class Report:
    """Prints results in one of llama-bench's formats as they come (JSON as one array at the end)."""

    SAMPLE_FIELDS = ("samples_ns", "samples_ts")  # JSON only, as in llama-bench's CSV

    def __init__(self, fmt: str, write: Callable[[str], None], backend: str):
        self.format, self.write, self.backend = fmt, write, backend
        self.records: list[dict] = []

    def add(self, setup: BenchSetup, result: BenchResult) -> None:
        rec = record(setup, result, self.backend)
        first = not self.records
        self.records.append(rec)
        if self.format == "md":
            if first:
                self.write("| model | size | params | backend | threads | sparsity | test | t/s | GB/s |\n"
                           "| --- | ---: | ---: | --- | ---: | --- | --- | ---: | ---: |\n")
            self.write(self._markdown_row(setup, result) + "\n")
        elif self.format == "jsonl":
            self.write(json.dumps(rec) + "\n")
        elif self.format == "csv":
            self.write(self._csv(rec, header=first))

    def finish(self) -> None:
        if self.format == "json":
            self.write(json.dumps(self.records, indent=2) + "\n")

    def _markdown_row(self, s: BenchSetup, r: BenchResult) -> str:
        # Weights are read once per forward pass: per token when generating, per batch for prompts.
        gbps = f"{r.mean * s.weight_bytes_per_token / 1e9:.1f}" if r.test.n_gen else ""
        return (f"| {s.model_type} | {s.model_size / 2**20:.2f} MiB | {s.model_n_params / 1e6:.2f} M | {self.backend} "
                f"| {s.n_threads} | {s.sparsity} | {r.test.name} | {r.mean:.2f} ± {r.std:.2f} | {gbps} |")

    def _csv(self, rec: dict, header: bool) -> str:
        fields = [k for k in rec if k not in self.SAMPLE_FIELDS]
        out = io.StringIO()
        writer = csv.writer(out, quoting=csv.QUOTE_ALL, lineterminator="\n")
        if header:
            out.write(",".join(fields) + "\n")
        writer.writerow([rec[k] for k in fields])
        return out.getvalue()
