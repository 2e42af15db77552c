"""Quality of TEAL-style input sparsity on every block linear: perplexity against model-wide sparsity.

For each model: calibration on wikitext-2 valid.txt only (powerinfer.sparse.calibrate), then
perplexity of test.txt (llama.cpp's method, c=512) with the block linears' inputs masked
(masked dense, on the torch path: the real kernel's quality up to its re-quantization of columns):
- uniform: every site at the target sparsity (TEAL's baseline), by the chosen criterion;
- the allocation (`--method`, default TEAL's block-wise greedy), at the same targets;
- the operating point `max_ppl_increase` picks on the calibration text (`--max-ppl-increase`).

    .venv/bin/python benchmarks/sparsity_quality.py --model smollm2 --model gemma3-270m [--chunks 100]

With `--cache DIR` each measured row is kept and reused, so a long run can be done in parts.
Writes benchmarks/results/sparsity_quality.md and benchmarks/results/sparsity_quality.png (`-o`, `--plot`).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from common import ROOT, benchmark_model, machine_description, run_perplexity, wikitext

RESULTS = ROOT / "benchmarks" / "results" / "sparsity_quality.md"
PLOT = ROOT / "benchmarks" / "results" / "sparsity_quality.png"
N_CTX = 512


def measure_model(name: str, n_chunks: int, args) -> tuple[str, list[tuple]]:
    """Rows (label, method, target, expected sparsity, ppl, error) for one model; the dense row first."""
    from powerinfer import LLM
    from powerinfer.sparse.allocate import Allocator
    from powerinfer.sparse.calibrate import calibrate, calibration_chunks
    from powerinfer.sparse.sites import masked
    from powerinfer.tools.perplexity import chunks_of

    path = benchmark_model(name)
    llm = LLM(str(path), n_ctx=N_CTX, threads=args.threads, sparsity="off")
    bos = llm.tokenizer.bos_id if llm.tokenizer.add_bos else None
    test = chunks_of(llm.tokenize(wikitext("test.txt")), N_CTX, n_chunks, bos)
    valid = llm.tokenize(wikitext("valid.txt"), add_bos=False)
    calibration = calibrate(llm.model, calibration_chunks(valid, bos, args.calibration_tokens, N_CTX))
    allocator = Allocator(calibration, args.criterion)
    logits_of = lambda: (lambda ids: torch.from_numpy(llm.logits(ids)))  # noqa: E731

    def measure(label: str, allocation) -> tuple:
        with masked(calibration.sites, allocation.thresholds if allocation else {}):
            result = run_perplexity(logits_of, test, f"{path.stem} {label}", args.cache)
        method, target, sparsity = (allocation.method, allocation.target, allocation.sparsity) if allocation else ("dense", 0.0, 0.0)
        return label, method, target, sparsity, result.ppl, result.error

    rows = [measure("dense", None)]
    for method in ("uniform", args.method):
        for target in args.targets:
            rows.append(measure(f"{args.criterion} {method} {target:.0%}", allocator.allocate(target, method)))
    if args.max_ppl_increase:
        chosen = allocator.within_perplexity(args.max_ppl_increase, args.method, chunks=args.search_chunks)
        rows.append(measure(f"{args.criterion} {args.method} max_ppl_increase {args.max_ppl_increase} "
                            f"({chosen.target:.1%})", chosen))
    return f"{path.name} ({len(test)} chunks)", rows


def write_results(results: dict[str, list[tuple]], args, output: Path) -> None:
    lines = [
        "# Perplexity under TEAL-style input sparsity of every block linear",
        "",
        f"{datetime.date.today()} · {machine_description()} · `benchmarks/sparsity_quality.py` · wikitext-2 test.txt, "
        f"c={N_CTX} · calibrated on valid.txt only ({args.calibration_tokens} tokens) · "
        f"criterion {args.criterion} · masked dense on the torch path (no column re-quantization)",
        "",
        f"Command: `.venv/bin/python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
        "",
        "Sparsity: the fraction of the block linears' weights not read per token (expected, on the calibration text).",
        "",
    ]
    for model, rows in results.items():
        base = rows[0][4]
        lines += [f"## {model}", "", "| row | sparsity | PPL | ± | × dense |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {label} | {s:.1%} | {ppl:.4f} | {err:.4f} | {ppl / base:.4f} |" for label, _, _, s, ppl, err in rows]
        within = [(s, label) for label, _, _, s, ppl, _ in rows if ppl <= 1.03 * base]
        best = max(within)
        lines += ["", f"Largest sparsity measured within 1.03x dense: {best[0]:.1%} ({best[1]}).", ""]
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(results: dict[str, list[tuple]], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (model, rows) in zip(axes[0], results.items()):
        base = rows[0][4]
        for method, marker in zip(("uniform", "blockwise", "global"), ("o-", "s-", "^-")):
            points = [(0.0, 1.0)] + sorted((s, ppl / base) for label, m, _, s, ppl, _ in rows
                                           if m == method and "max_ppl" not in label)
            if len(points) > 1:
                ax.plot([100 * s for s, _ in points], [r for _, r in points], marker, label=f"{args.criterion} {method}")
        ax.axhline(1.03, color="grey", lw=0.8, ls=":", label="1.03 × dense")
        ax.set_yscale("log")
        ax.set_xlabel("block linear weights not read per token (%)")
        ax.set_ylabel("perplexity / dense")
        ax.set_title(f"{model}: wikitext-2 test, c={N_CTX}", fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None,
                        help="smollm2, gemma3-270m or a GGUF path (repeatable; default: both named models)")
    parser.add_argument("--chunks", type=lambda s: [int(c) for c in s.split(",")], default=[100],
                        help="chunks of test.txt, one number for every model or one per --model (default: 100)")
    parser.add_argument("--targets", type=lambda s: [float(t) for t in s.split(",") if t], default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7],
                        help="model-wide target sparsities (comma-separated)")
    parser.add_argument("--method", default="blockwise", choices=("blockwise", "global"), help="the allocation compared to uniform")
    parser.add_argument("--criterion", default="wina", choices=("teal", "wina"))
    parser.add_argument("--max-ppl-increase", type=float, default=1.03, help="also the operating point within this factor (0: none)")
    parser.add_argument("--search-chunks", type=int, default=4,
                        help="calibration chunks whose perplexity the --max-ppl-increase search measures")
    parser.add_argument("--calibration-tokens", type=int, default=8192)
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None, help="keep each measured row here and reuse it")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    parser.add_argument("--plot", type=Path, default=PLOT)
    args = parser.parse_args()
    models = args.model or ["smollm2", "gemma3-270m"]
    chunks = args.chunks * len(models) if len(args.chunks) == 1 else args.chunks
    if len(chunks) != len(models):
        parser.error("--chunks: one number, or one per --model")
    results = {}
    for name, n in zip(models, chunks):  # written after each model: a long run shows its first part early
        model, rows = measure_model(name, n, args)
        results[model] = rows
        write_results(results, args, args.output)
        plot(results, args, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
