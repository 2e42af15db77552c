"""Quality (and decode speed) of TEAL-style input sparsity on every block linear and the output head,
measured on the sparsified files themselves.

For each model: one calibration on wikitext-2 valid.txt only, with `powerinfer sparsify`'s defaults
(`calibration_of`); from it, for each allocation method and target, the file `sparsify --all-sites`
writes (`write_sparsified` with `all_sites`: the source's tensors and thresholds for every skipping
site, whatever this CPU's timings say pays), and the file `powerinfer sparsify` writes by default on
this machine (the largest target within DEFAULT_MAX_PPL_INCREASE of the dense perplexity on the
calibration text, spread over the sites whose skipping pays here). Each file's perplexity on
test.txt (llama.cpp's method, c=512) is measured through the engine, `LLM(file)` with
`sparsity="auto"`: what decode computes (the channel runs hold the source's own weights). The dense
row is the source file itself. The measured sparsity is the share of the sites' weights (block
linears and head) each token skipped on the test text (a site without thresholds counts as 0).

    .venv/bin/python benchmarks/sparsity_quality.py --model smollm2 --model gemma3-270m --chunks 100 \\
        --cache ~/.cache/powerinfer/bench/sparse/rows [--speed]

`--cache DIR` keeps each measured perplexity row and reuses it, so a long run can be done in parts.
The sparsified files are kept in ~/.cache/powerinfer/bench/sparse/, named by their source file, a
digest of the calibration's inputs (source name and size, calibration text, token count), method
and target, and reused when present (clear the folder after a change to sparsify's output).
`--speed`: also decode tok/s (greedy single-token steps after a short prompt, median of `--reps`
runs after a warm-up) and the weight bytes read per token (the sparse linears' selected channels,
the other linears whole), one file loaded at a time.
Writes benchmarks/results/sparsity_quality.md and benchmarks/results/sparsity_quality.png (`-o`, `--plot`).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path

import torch

from powerinfer import LLM
from powerinfer.gguf import open_gguf
from powerinfer.sparse.allocate import Allocator
from powerinfer.sparse.calibrate import DEFAULT_TOKENS
from powerinfer.sparse.columns import ColumnLinear
from powerinfer.sparse.payoff import decode_rate
from powerinfer.sparse.sites import model_sites
from powerinfer.sparse.sparsify import (
    DEFAULT_MAX_PPL_INCREASE,
    Target,
    calibration_of,
    model_break_even,
    taking_part,
    write_sparsified,
)
from powerinfer.sparse.storage import TARGET_KEY
from powerinfer.tools.perplexity import chunks_of

from common import (
    LLAMA_CPP_BUILDS,
    ROOT,
    benchmark_model,
    bytes_per_token,
    cached_row,
    machine_description,
    run_perplexity,
    wikitext,
)

RESULTS = ROOT / "benchmarks" / "results" / "sparsity_quality.md"
PLOT = ROOT / "benchmarks" / "results" / "sparsity_quality.png"
SPARSE_FILES = LLAMA_CPP_BUILDS / "sparse"
N_CTX = 512
METHODS = ("uniform", "blockwise", "measured")  # "measured": the file of whichever of the two it chooses
SPEED_PROMPT = "The tower is 324 metres tall, about the same height as an 81-storey building"


@dataclass
class Row:
    """One measured file (`path()` gives it, written on first need); `target` as asked for (the
    default row: read from its file), `sparsity` measured on the test text."""

    label: str
    method: str
    target: float | None
    path: Callable[[], Path]
    ppl: float = 0.0
    error: float = 0.0
    sparsity: float = 0.0
    speed: dict = field(default_factory=dict)  # tok_s, bytes (per token), with --speed


class Calibrated:
    """One source model's calibration with sparsify's defaults, computed on first need (only when a
    sparsified file is missing), and the files written from it."""

    def __init__(self, source: Path, threads: int):
        self.source, self.threads = source, threads
        self.text = wikitext("valid.txt")
        # "all-sites": every skipping site (the head's too) given its thresholds (sparsify's all_sites),
        # whatever this CPU's timings say pays, so that the figures are the allocation's on any machine;
        # the default point is what `powerinfer sparsify` writes on this one
        inputs = (f"all-sites+head {source.name} {source.stat().st_size} {DEFAULT_TOKENS} "
                  f"{hashlib.sha256(self.text.encode()).hexdigest()}")
        self.digest = hashlib.sha256(inputs.encode()).hexdigest()[:10]

    @cached_property
    def llm(self):
        return LLM(str(self.source), threads=self.threads, sparsity="off")  # as the sparsify command loads it

    @cached_property
    def calibration(self):
        return calibration_of(self.llm, self.text)

    @cached_property
    def allocator(self):
        return Allocator(self.calibration)

    def chosen(self, target: float) -> str:
        """The method sparsify's default allocation ("measured") chooses at `target`, all sites taking part."""
        return self.allocator.allocate(target, "measured").method

    @cached_property
    def break_even(self):
        return model_break_even(self.calibration.sites)

    @cached_property
    def paying_allocator(self):
        """sparsify's: the target spread over the sites whose skipping pays on this machine."""
        return Allocator(self.calibration, taking_part=taking_part(self.calibration.sites, self.break_even))

    def file(self, method: str, target: float | None) -> Path:
        """The sparsified file for `method` at `target` (None: sparsify's default point, written as the
        command writes it on this machine), written if missing."""
        name = f"{method}-{round(100 * target)}" if target is not None else "default"
        path = SPARSE_FILES / f"{self.source.stem}.{self.digest}.{name}.gguf"
        if not path.exists():
            SPARSE_FILES.mkdir(parents=True, exist_ok=True)
            print(f"writing {path}", file=sys.stderr)
            if target is None:
                write_sparsified(self.llm, self.paying_allocator, path, Target(), method, break_even=self.break_even)
            else:
                write_sparsified(self.llm, self.allocator, path, Target(sparsity=target), method, all_sites=True)
        return path


def target_of(path: Path) -> float:
    """The model-wide sparsity a sparsified file's thresholds were chosen for (on the calibration text)."""
    return float(open_gguf(path).get(TARGET_KEY))


class SelectionCounter:
    """Logits of a file through the engine (one forward per chunk), counting after each forward the
    channels each sparse linear selected: the model-wide share of the sites' weights (block linears
    and head) skipped."""

    def __init__(self, path: Path, threads: int):
        self.llm = LLM(str(path), n_ctx=N_CTX, n_batch=N_CTX, threads=threads)
        self.sites = model_sites(self.llm.model)
        self.total_weights = sum(s.weight_count for s in self.sites)
        self.skipped = self.rows = 0.0

    def __call__(self, ids: list[int]):
        logits = torch.from_numpy(self.llm.logits(ids))
        for site in self.sites:
            linear = site.linear
            if isinstance(linear, ColumnLinear):
                self.skipped += site.weight_count * (len(ids) - linear.last_selected / linear.in_features)
        self.rows += len(ids)
        return logits

    @property
    def sparsity(self) -> float:
        return self.skipped / (self.rows * self.total_weights) if self.rows else 0.0


def measure_ppl(row: Row, chunks: list[list[int]], key: str, args) -> None:
    """The row's perplexity, measured sparsity and (default row) target; from the cache when kept there."""
    counter: list[SelectionCounter] = []

    def logits_of():
        counter.append(SelectionCounter(row.path(), args.threads))
        return counter[0]

    def extra() -> dict:
        return {"sparsity": counter[0].sparsity, "target": target_of(row.path()) if row.method != "dense" else 0.0}

    result = run_perplexity(logits_of, chunks, key, args.cache, extra)
    row.ppl, row.error, row.sparsity = result.ppl, result.error, result.extra["sparsity"]
    if row.target is None:
        row.target = result.extra["target"]


def measure_speed(row: Row, args) -> None:
    llm = LLM(str(row.path()), threads=args.threads)
    prompt = llm.tokenize(SPEED_PROMPT)
    rates = [decode_rate(llm, prompt, args.n_gen) for _ in range(args.reps + 1)][1:]  # the first warms up
    row.speed = {"tok_s": statistics.median(rates), "bytes": bytes_per_token(llm, prompt, args.n_gen)}
    print(f"{row.label}: {row.speed['tok_s']:.1f} tok/s, {row.speed['bytes'] / 1e6:.1f} MB/token", file=sys.stderr)


def measure_model(name: str, n_chunks: int, args) -> tuple[str, list[Row]]:
    """The rows of one model, the dense source first, each measured as it comes (its file written then)."""

    source = benchmark_model(name)
    tokenizer = LLM(str(source), n_ctx=N_CTX, sparsity="off").tokenizer
    test = chunks_of(tokenizer.encode(wikitext("test.txt")), N_CTX, n_chunks, tokenizer.bos_id if tokenizer.add_bos else None)
    calibrated = Calibrated(source, args.threads)
    # measured in this order (dense, the default point, then each target under each method), so that a
    # run cut short has the figures first; shown by method and target
    rows = [(Row("dense", "dense", 0.0, lambda: source), f"{source.stem} dense")]
    if args.default_point:
        rows.append((Row(f"sparsify default (≤ {DEFAULT_MAX_PPL_INCREASE}x PPL on valid, sites that pay here)", "default", None,
                         partial(calibrated.file, "measured", None)), f"{source.stem} {calibrated.digest} default"))
    for target in args.targets:
        for method in args.methods:
            written = calibrated.chosen(target) if method == "measured" else method  # the same file, the same row
            label = f"{method} {target:.0%}" + (f" (= {written})" if written != method else "")
            rows.append((Row(label, method, target, partial(calibrated.file, written, target)),
                         f"{source.stem} {calibrated.digest} {written} {target:.0%}"))
    if args.cached_only:
        rows = [(row, key) for row, key in rows if cached_row(args.cache, test, key).exists()]
    for row, key in rows:
        measure_ppl(row, test, key, args)
        if args.speed:
            measure_speed(row, args)
    shown = ("dense", *METHODS, "default")
    rows.sort(key=lambda r: (shown.index(r[0].method), r[0].target))
    return f"{source.name} ({len(test)} chunks)", [row for row, _ in rows]


def write_results(results: dict[str, list[Row]], args, output: Path) -> None:
    speed = any(row.speed for rows in results.values() for row in rows)
    lines = [
        "# Perplexity under TEAL-style input sparsity of every block linear and the output head, on the sparsified files",
        "",
        f"{datetime.date.today()} · {machine_description()} · `benchmarks/sparsity_quality.py` · wikitext-2 test.txt, "
        f"c={N_CTX} · calibrated once per model on valid.txt only (sparsify's defaults: {DEFAULT_TOKENS} tokens, "
        "WINA criterion) · each row is the file `powerinfer sparsify` writes, run by the engine (`LLM(file)`, "
        "sparsity auto)",
        "",
        f"Command: `.venv/bin/python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
        "",
        "Target: the model-wide sparsity asked for (default row: the one sparsify chose). Sparsity: measured on "
        "the test text, the share of the sites' weights (block linears and head) not read per token.",
        "",
    ]
    if speed:
        lines += [f"Decode: {args.threads} threads, {args.n_gen} greedy tokens after a short prompt, median of "
                  f"{args.reps} runs after a warm-up, one file at a time. MB/token: the sparse linears' (block and head) "
                  "selected channels and the other linears whole, mean over the decoded tokens.", ""]
    for model, rows in results.items():
        base = rows[0]
        header = "| row | method | target | sparsity | PPL | ± | × dense |"
        rule = "| --- | --- | ---: | ---: | ---: | ---: | ---: |"
        if speed:
            header, rule = header + " tok/s | × dense | MB/token |", rule + " ---: | ---: | ---: |"
        lines += [f"## {model}", "", header, rule]
        for row in rows:
            line = (f"| {row.label} | {row.method} | {row.target:.1%} | {row.sparsity:.1%} | {row.ppl:.4f} | "
                    f"{row.error:.4f} | {row.ppl / base.ppl:.4f} |")
            if speed and row.speed and base.speed:
                line += (f" {row.speed['tok_s']:.1f} | {row.speed['tok_s'] / base.speed['tok_s']:.2f} | "
                         f"{row.speed['bytes'] / 1e6:.1f} |")
            elif speed:
                line += " | | |"
            lines.append(line)
        within = [(row.sparsity, row.label) for row in rows if row.ppl <= 1.03 * base.ppl]
        best = max(within)
        lines += ["", f"Largest measured sparsity within 1.03x dense: {best[0]:.1%} ({best[1]})."]
        default = next((row for row in rows if row.method == "default"), None)
        if default:
            verdict = "within" if default.ppl <= 1.03 * base.ppl else "NOT within"
            lines.append(f"Default operating point: {default.ppl / base.ppl:.4f}x dense at {default.sparsity:.1%} "
                         f"measured sparsity: {verdict} 1.03x.")
        lines.append("")
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(results: dict[str, list[Row]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    speed = any(row.speed for rows in results.values() for row in rows)
    fig, axes = plt.subplots(2 if speed else 1, len(results), figsize=(6 * len(results), 8 if speed else 4), squeeze=False)
    for column, (model, rows) in enumerate(results.items()):
        base = rows[0]
        figures = [("perplexity / dense", lambda r, base=base: r.ppl / base.ppl)]
        if speed:
            figures.append(("decode tok/s", lambda r: r.speed.get("tok_s")))
        for (ylabel, value), ax in zip(figures, axes[:, column]):
            for method, marker in zip(METHODS, ("o-", "s-", "^:")):
                points = sorted((100 * r.sparsity, value(r)) for r in rows if r.method in (method, "dense"))
                points = [p for p in points if p[1] is not None]
                if len(points) > 1:
                    ax.plot(*zip(*points), marker, label=method)
            for r in rows:
                if r.method == "default" and value(r) is not None:
                    ax.plot(100 * r.sparsity, value(r), "*", ms=12, color="C3", label="sparsify's default")
            if ylabel.startswith("perplexity"):
                ax.axhline(1.03, color="grey", lw=0.8, ls=":", label="1.03 × dense")
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(ScalarFormatter())
                ax.yaxis.set_minor_formatter(ScalarFormatter())
            elif base.speed:
                ax.axhline(base.speed["tok_s"], color="grey", lw=0.8, ls=":", label="dense")
            ax.set_xlabel("weights of the sites (block linears, head) not read per token, measured (%)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}: wikitext-2 test, c={N_CTX}", fontsize=9)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None,
                        help="smollm2, gemma3-270m or a GGUF path (repeatable; default: both named models)")
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[100],
                        help="chunks of test.txt, one number for every model or one per --model (default: 100)")
    parser.add_argument("--targets", type=lambda s: [float(t) for t in s.split(",") if t],
                        default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], help="model-wide target sparsities (comma-separated)")
    parser.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m], default=list(METHODS),
                        help="allocation methods (comma-separated; default: uniform,blockwise,measured)")
    parser.add_argument("--default-point", action=argparse.BooleanOptionalAction, default=True,
                        help="also the file at sparsify's default target")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None, help="keep each measured perplexity row here and reuse it")
    parser.add_argument("--cached-only", action="store_true",
                        help="the table of the rows in --cache only (a run done in parts, not finished)")
    parser.add_argument("--speed", action="store_true", help="also decode tok/s and bytes read per token of each file")
    parser.add_argument("--n-gen", type=int, default=64, help="tokens per decode run (--speed)")
    parser.add_argument("--reps", type=int, default=5, help="decode runs per file (--speed)")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    args = parser.parse_args()
    if args.cached_only and args.cache is None:
        parser.error("--cached-only needs --cache")
    if unknown := set(args.methods) - set(METHODS):
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))} (expected {', '.join(METHODS)})")
    models = args.model or ["smollm2", "gemma3-270m"]
    chunks = args.chunks * len(models) if len(args.chunks) == 1 else args.chunks
    if len(chunks) != len(models):
        parser.error("--chunks: one number, or one per --model")
    results = {}
    for name, n in zip(models, chunks):  # written after each model: a long run shows its first part early
        model, rows = measure_model(name, n, args)
        results[model] = rows
        write_results(results, args, args.output)
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
