"""Perplexity of one GGUF file run by us and by llama.cpp, on the same wikitext-2 test chunks.

llama.cpp's `llama-perplexity` method (c=512, each chunk scored on its second half; BOS first where
the model wants one), computed from our logits and from llama-cpp-python's; both see the same token
ids (our tokenizer's). With `--requantize TYPE` the file is first re-quantized by `powerinfer
quantize` (e.g. SmolLM2 Q4_1 -> Q4_K_M with --allow-requantize), and that file is measured.

    .venv/bin/python benchmarks/perplexity_vs_llamacpp.py --model gemma3-270m --chunks 100
    .venv/bin/python benchmarks/perplexity_vs_llamacpp.py --requantize Q4_K_M --chunks 100

Writes benchmarks/results/perplexity_<file stem>.md.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

from common import (
    MODEL_NAMES,
    ROOT,
    benchmark_model,
    ensure_llama_cpp,
    llama_cpp_logits,
    machine_description,
    run_perplexity,
    wikitext,
)

N_CTX = 512
TOLERANCE = 0.01  # the two engines' perplexities may differ by this fraction


def requantized(model: Path, kind: str) -> Path:
    """`model` re-quantized to `kind` by our quantizer, kept beside it (made once)."""
    out = model.with_name(f"{model.stem}.requantized-{kind}.gguf")
    if not out.exists():
        print(f"powerinfer quantize {model.name} -> {out.name} ...", file=sys.stderr)
        subprocess.run([Path(sys.executable).with_name("powerinfer"), "quantize", "--allow-requantize", str(model), str(out), kind],
                       check=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"GGUF file, or one of {', '.join(MODEL_NAMES)} (default: smollm2)")
    parser.add_argument("--requantize", metavar="TYPE", help="measure the model re-quantized to TYPE by powerinfer quantize")
    parser.add_argument("--chunks", type=int, default=None, help="chunks of test.txt (default: all)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None, help="keep each measured row here and reuse it")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="results file (default: benchmarks/results/perplexity_<file stem>.md)")
    args = parser.parse_args()

    import torch

    from powerinfer import LLM
    from powerinfer.tools.perplexity import chunks_of

    model = benchmark_model(args.model)
    if args.requantize:
        model = requantized(model, args.requantize)
    ensure_llama_cpp()
    ours = LLM(str(model), n_ctx=N_CTX, threads=args.threads, sparsity="off")
    tokens = ours.tokenize(wikitext("test.txt"), add_bos=True)
    bos = ours.tokenizer.bos_id if ours.tokenizer.add_bos else None
    chunks = chunks_of(tokens, N_CTX, args.chunks, bos)

    measured = {
        "powerinfer": run_perplexity(lambda: (lambda ids: torch.from_numpy(ours.logits(ids))), chunks,
                                     f"powerinfer {model.name}", args.cache),
        "llama.cpp": run_perplexity(lambda: llama_cpp_logits(str(model), args.threads, N_CTX), chunks,
                                    f"llama.cpp {model.name}", args.cache),
    }
    reference = measured["llama.cpp"].ppl
    difference = measured["powerinfer"].ppl / reference - 1
    lines = [
        f"# Perplexity, powerinfer vs llama.cpp: `{model.name}`",
        "",
        f"{datetime.date.today()} · {machine_description()} · wikitext-2 test.txt, c={N_CTX}, "
        f"{len(chunks)} of the file's {len(tokens) // N_CTX} chunks, the same token ids for both engines",
        "",
        f"Command: `.venv/bin/python benchmarks/{Path(sys.argv[0]).name} {' '.join(sys.argv[1:])}`",
        "",
        "| engine | PPL | ± |",
        "| --- | ---: | ---: |",
        *(f"| {engine} | {m.ppl:.4f} | {m.error:.4f} |" for engine, m in measured.items()),
        "",
        f"powerinfer / llama.cpp - 1 = {difference:+.3%} ({'within' if abs(difference) <= TOLERANCE else 'outside'} "
        f"±{TOLERANCE:.0%}).",
    ]
    output = args.output or ROOT / "benchmarks" / "results" / f"perplexity_{model.stem}.md"
    output.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
