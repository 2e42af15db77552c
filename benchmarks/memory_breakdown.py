"""Where a process's resident memory goes, step by step, for us and for llama.cpp, on one model.

Each engine runs in its own fresh process (so that neither counts the other's libraries) and walks
the steps of a load and a benchmark run: our steps are those `LLM(...)` takes, in its order. After
each step the worker reads VmRSS (resident now) and VmHWM (the peak so far) from /proc/self/status;
a step whose peak exceeds what it leaves resident had a transient (e.g. the tokenizer's build).
Writes benchmarks/results/memory_<model>.md and, with matplotlib, a bar chart beside it.

    .venv/bin/python benchmarks/memory_breakdown.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LLAMA_CPP_PYTHON,
    MODEL_NAMES,
    ROOT,
    benchmark_model,
    ensure_llama_cpp,
    machine_description,
    wikitext,
)

RESULTS = ROOT / "benchmarks" / "results"
ENGINES = ("powerinfer", "llama.cpp")


def _status() -> dict[str, int]:
    """VmRSS and VmHWM in bytes."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024 for key in ("VmRSS", "VmHWM")}


def _report(step: str) -> None:
    print(json.dumps({"step": step, **_status()}), flush=True)


def _powerinfer_steps(model: str, threads: int, n_ctx: int, prompt: list[int], generated: list[int]) -> None:
    _report("interpreter")
    import torch

    _report("import torch")
    from powerinfer.gguf.reader import open_gguf
    from powerinfer.models import FFNOptions, load_model, read_config
    from powerinfer.runtime.engine import Engine
    from powerinfer.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    _report("import powerinfer")
    gguf = open_gguf(model)
    config = read_config(gguf)
    _report("open the file (metadata as Python values)")
    tokenizer = Tokenizer.from_gguf(gguf)
    _report("build the tokenizer")
    gguf.drop_metadata("tokenizer.ggml.")
    _report("drop the vocabulary's metadata")
    model_ = load_model(gguf, n_ctx, FFNOptions(sparsity="off"), config)
    del gguf
    _report("load the weights")
    engine = Engine(model_, n_ctx)
    engine.prefill(0, prompt)
    _report(f"prefill pp{len(prompt)}")
    engine.release(0)
    for token in generated:
        engine.decode([(0, token)])
    _report(f"decode tg{len(generated)}")
    del tokenizer


def _llama_cpp_steps(model: str, threads: int, n_ctx: int, prompt: list[int], generated: list[int]) -> None:
    _report("interpreter")
    import llama_cpp

    _report("import llama_cpp")
    llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512, verbose=False)
    _report("load (file mapped, tokenizer, KV cache, compute buffers)")

    def run(ids: list[int]) -> None:
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        if llama_cpp.llama_decode(llm.ctx, llama_cpp.llama_batch_get_one(tokens, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")

    run(prompt)
    _report(f"prefill pp{len(prompt)}")
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
    for token in generated:
        run([token])
    _report(f"decode tg{len(generated)}")


WORKERS: dict[str, Callable[..., None]] = {"powerinfer": _powerinfer_steps, "llama.cpp": _llama_cpp_steps}


def _measure(engine: str, model: str, threads: int, n_ctx: int, prompt: list[int], generated: list[int]) -> list[dict]:
    process = subprocess.run(
        [sys.executable, __file__, "--worker", engine, "--model", model, "--threads", str(threads), "--n-ctx", str(n_ctx)],
        input=json.dumps({"prompt": prompt, "generated": generated}), capture_output=True, text=True, check=True)
    return [json.loads(line) for line in process.stdout.splitlines() if line.startswith("{")]


def _table(engine: str, steps: list[dict]) -> list[str]:
    rows = [f"### {engine}", "", "| step | resident after (MiB) | step's share (MiB) | peak so far (MiB) |",
            "| --- | ---: | ---: | ---: |"]
    before = 0
    for step in steps:
        rss, peak = step["VmRSS"] / 2**20, step["VmHWM"] / 2**20
        rows.append(f"| {step['step']} | {rss:.0f} | {rss - before:+.0f} | {peak:.0f} |")
        before = rss
    return rows


def _plot(results: dict[str, list[dict]], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.9 * len(results)))
    for row, steps in enumerate(results.values()):
        before = 0.0
        for step, colour in zip(steps, plt.cm.tab20.colors):
            # a segment from the resident size before the step to after it; a step that frees
            # memory draws nothing, and the next segment starts lower, over the freed part
            rss = step["VmRSS"] / 2**20
            if rss > before:
                ax.barh(row, rss - before, left=before, color=colour, edgecolor="white")
                if rss - before > 25:
                    ax.text((before + rss) / 2, row, step["step"].split(" (")[0], ha="center", va="center", fontsize=7)
            before = rss
        ax.plot([max(s["VmHWM"] for s in steps) / 2**20] * 2, [row - 0.45, row + 0.45], color="black")
    ax.set_yticks(range(len(results)), list(results))
    ax.set_xlabel("resident memory (MiB); black line: peak")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"GGUF file, or one of {', '.join(MODEL_NAMES)} (default: smollm2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--n-ctx", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    named = args.model
    args.model = str(benchmark_model(args.model))
    if args.worker:
        ids = json.loads(sys.stdin.read())
        WORKERS[args.worker](args.model, args.threads, args.n_ctx, ids["prompt"], ids["generated"])
        return
    if "llama.cpp" in args.engines:
        ensure_llama_cpp()
    from powerinfer import LLM

    ids = LLM(args.model, n_ctx=64).tokenize(wikitext("test.txt")[:200000], add_bos=False)
    prompt, generated = ids[: args.n_prompt], ids[args.n_prompt : args.n_prompt + args.n_gen]
    n_ctx = args.n_prompt + args.n_gen + 8  # as compare_engines.py
    results = {engine: _measure(engine, args.model, args.threads, n_ctx, prompt, generated) for engine in args.engines}

    stem = Path(args.model).stem
    out = RESULTS / f"memory_{stem}.md"
    report = ["# Resident memory, step by step", "",
              f"Measured {datetime.date.today().isoformat()} on {machine_description()}.",
              f"Model: `{Path(args.model).name}`; {args.threads} threads; n_ctx {n_ctx}; llama.cpp through "
              f"{LLAMA_CPP_PYTHON}. Each engine in a fresh process; VmRSS/VmHWM after each step.", ""]
    for engine, steps in results.items():
        report += _table(engine, steps) + [""]
        print("\n".join(_table(engine, steps)) + "\n")
    if _plot(results, out.with_suffix(".png")):
        report += [f"![resident memory by step]({out.with_suffix('.png').name})", ""]
    report += [f"Command: `.venv/bin/python benchmarks/memory_breakdown.py{f' --model {named}' if named else ''} "
               f"--threads {args.threads}`"]
    out.write_text("\n".join(report) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
