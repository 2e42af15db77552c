"""SmolLM2 quality under activation sparsity: perplexity of wikitext-2 test (llama.cpp's method, c=512).

Rows, in one run on the same file and chunks:
- dense (ours), and llama.cpp's `llama-perplexity` method computed with llama-cpp-python logits;
- oracle sparsity: thresholds calibrated on valid.txt for target sparsities, every token skipping
  exactly the neurons under them;
- predicted sparsity: PowerInfer GGUF files with predictors trained on valid.txt (made beforehand
  with `powerinfer train-predictors` and `powerinfer convert`), with the sparsity they reach.

    .venv/bin/python benchmarks/sparsity_perplexity.py --predicted 0.5=/path/model.pwri.gguf [--chunks N]

The llama.cpp row installs llama-cpp-python (the version compare_engines.py pins) if it is missing.

A whole-file run takes a while; with `--cache DIR` each row is kept once measured, so rows can be
measured in parts (`--only llama.cpp`) and the table assembled by a last run.

Writes benchmarks/results/sparsity_perplexity.md and docs/sparsity_perplexity.png (`-o`, `--plot`).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from common import ROOT, Measured, ensure_llama_cpp, llama_cpp_logits, machine_description, run_perplexity, wikitext

RESULTS = ROOT / "benchmarks" / "results" / "sparsity_perplexity.md"
PLOT = ROOT / "docs" / "sparsity_perplexity.png"
N_CTX = 512


def measured_sparsity(llm, chunks) -> float:
    """Mean fraction of FFN neurons skipped per token on a few of the chunks (decode-sized steps)."""
    skipped, total = 0, 0
    for chunk in chunks[:2]:
        llm.engine.release(0)
        llm.engine.prefill(0, chunk[:8], reuse_prefix=False)
        for token in chunk[8:136]:
            llm.engine.decode([(0, token)])
            for block in llm.model.blocks:
                skipped += block.ffn.store.n_ff - block.ffn.last_active
                total += block.ffn.store.n_ff
    return skipped / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default=None, help="dense GGUF (default: the default model)")
    parser.add_argument("--chunks", type=int, default=None, help="chunks of test.txt (default: all)")
    parser.add_argument("--oracle", default="0.3,0.5,0.7,0.8,0.9", help="target sparsities for the oracle curve")
    parser.add_argument("--predicted", action="append", default=[], metavar="TARGET=FILE",
                        help="PowerInfer GGUF with predictors trained for this target sparsity (repeatable)")
    parser.add_argument("--calibration-tokens", type=int, default=16384)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--llama-cpp-threads", type=int, default=None,
                        help="threads for llama.cpp (default: --threads; 1 is steadier on a busy machine)")
    parser.add_argument("--only", default=None,
                        help="measure only these rows (comma-separated: dense, llama.cpp, oracle, predicted); with --cache")
    parser.add_argument("--cache", type=Path, default=None, help="keep each measured row here and reuse it")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS, help=f"markdown table (default: {RESULTS})")
    parser.add_argument("--plot", type=Path, default=PLOT, help=f"plot of the curve (default: {PLOT}); 'none' for no plot")
    args = parser.parse_args()

    from powerinfer import LLM
    from powerinfer.hub import resolve_model
    from powerinfer.runtime.engine import Engine
    from powerinfer.sparse.profiler import calibrate_thresholds, calibration_chunks
    from powerinfer.tools.perplexity import chunks_of

    model = str(resolve_model(args.model))
    dense = LLM(model, n_ctx=N_CTX, threads=args.threads, sparsity="off")
    tokens = dense.tokenize(wikitext("test.txt"), add_bos=True)
    bos = dense.tokenizer.bos_id if dense.tokenizer.add_bos else None
    chunks = chunks_of(tokens, N_CTX, args.chunks, bos)
    wanted = set(args.only.split(",")) if args.only else {"dense", "llama.cpp", "oracle", "predicted"}
    if args.no_llama_cpp:
        wanted.discard("llama.cpp")
    if "llama.cpp" in wanted:
        ensure_llama_cpp()

    def measure(kind: str, label: str, logits_of: Callable[[], Callable]) -> Measured | None:
        if kind not in wanted:
            return None
        return run_perplexity(logits_of, chunks, label, args.cache)

    def ours(llm):
        return lambda: (lambda ids: torch.from_numpy(llm.logits(ids)))

    rows = []  # (kind, target, measured sparsity, ppl, error)
    if (base := measure("dense", "dense", ours(dense))) is not None:
        rows.append(("dense", None, 0.0, base.ppl, base.error))
    llama_threads = args.llama_cpp_threads or args.threads
    if (reference := measure("llama.cpp", "llama.cpp", lambda: llama_cpp_logits(model, llama_threads, N_CTX))) is not None:
        rows.append(("llama.cpp dense", None, 0.0, reference.ppl, reference.error))

    calibration_ids = dense.tokenize(wikitext("valid.txt"), add_bos=False)
    calibration = calibration_chunks(calibration_ids, args.calibration_tokens, N_CTX)
    for target in [float(t) for t in args.oracle.split(",") if t and "oracle" in wanted]:
        thresholds, _ = calibrate_thresholds(dense.model, Engine(dense.model, N_CTX), calibration, target, None)
        oracle = LLM(model, n_ctx=N_CTX, threads=args.threads, sparsity="oracle", thresholds=thresholds)
        result = measure("oracle", f"oracle {target:.0%}", ours(oracle))
        rows.append(("oracle", target, measured_sparsity(oracle, chunks), result.ppl, result.error))
    for spec in args.predicted if "predicted" in wanted else []:
        target, path = spec.split("=", 1)
        predicted = LLM(path, n_ctx=N_CTX, threads=args.threads, sparsity="auto")
        result = measure("predicted", f"predicted {target} {Path(path).name}", ours(predicted))
        rows.append(("predicted", float(target), measured_sparsity(predicted, chunks), result.ppl, result.error))
    if not rows or rows[0][0] != "dense":
        print("measured; the table needs the dense row too (rerun with --cache and without --only)", file=sys.stderr)
        return 0

    write_results(rows, len(chunks), model, args.output)
    if str(args.plot) != "none":
        plot(rows, args.plot, len(chunks))
    return 0


def write_results(rows, n_chunks: int, model: str, output: Path) -> None:
    base = rows[0][3]
    lines = [
        "# SmolLM2 perplexity under activation sparsity",
        "",
        f"{datetime.date.today()} · {machine_description()} · "
        f"`benchmarks/sparsity_perplexity.py` · model `{Path(model).name}` · wikitext-2 test.txt, c={N_CTX}, "
        f"{n_chunks} chunks · thresholds and predictors from valid.txt only",
        "",
        f"Command: `.venv/bin/python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
        "",
        "| mode | target sparsity | measured sparsity (decode) | PPL | ± | × dense |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind, target, sparsity, ppl, error in rows:
        target_text = "" if target is None else f"{target:.0%}"
        lines.append(f"| {kind} | {target_text} | {sparsity:.1%} | {ppl:.4f} | {error:.4f} | {ppl / base:.4f} |")
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows, path: Path, n_chunks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0][3]
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in (("oracle", "o-"), ("predicted", "s--")):
        points = sorted((s, p / base) for k, _, s, p, _ in rows if k == kind)
        if points:
            ax.plot([100 * s for s, _ in points], [r for _, r in points], marker, label=kind)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.02, color="grey", lw=0.8, ls=":", label="1.02 × dense")
    ax.set_xlabel("FFN neurons skipped per token (%)")
    ax.set_ylabel("perplexity / dense")
    ax.set_title(f"SmolLM2-135M, wikitext-2 test ({n_chunks} chunks of {N_CTX})")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
