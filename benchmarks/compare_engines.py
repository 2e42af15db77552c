"""Dense engines side by side: powerinfer vs llama.cpp (llama-cpp-python) vs Hugging Face transformers.

Same GGUF, same thread count, one run. Each engine lives in its own worker process (so its peak
RSS is its own); the controller interleaves their repetitions so machine noise hits all alike.

    .venv/bin/python benchmarks/compare_engines.py            # installs llama-cpp-python if missing
    .venv/bin/python benchmarks/compare_engines.py --engines powerinfer llama.cpp
    .venv/bin/python benchmarks/compare_engines.py --model gemma3-270m --engines powerinfer llama.cpp
    .venv/bin/python benchmarks/compare_engines.py --isa avx2   # like with like on an AVX-512 machine

`--isa` (default: the CPU's best) forces powerinfer's kernels to that instruction set
(POWERINFER_ISA) and loads llama.cpp built for it alone (`common.ensure_llama_cpp`); each row
says which instruction set its engine ran, as the engine itself reports it.

Writes benchmarks/results/dense_engines.md (linked from the README) for the default model, else
benchmarks/results/dense_engines_<model file stem>.md; runs on AVX2 add `_avx2` to the name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (
    ISAS,
    LLAMA_CPP_CMAKE_ARGS,
    LLAMA_CPP_PYTHON,
    MODEL_NAMES,
    ROOT,
    benchmark_model,
    bytes_per_token,
    cpu_isa,
    ensure_llama_cpp,
    interleaved,
    isa_environment,
    llama_cpp_isa,
    machine_description,
    memory_read_rate,
    paired_ratio,
    peak_rss,
    wikitext,
)

RESULTS = ROOT / "benchmarks" / "results"


# ---------------------------------------------------------------- workers (one engine each)

class PowerInferWorker:
    sparsity = "off"

    def __init__(self, model: str, threads: int, n_ctx: int, isa: str):
        from powerinfer import LLM
        from powerinfer.ops import native

        self.llm = LLM(model, threads=threads, n_ctx=n_ctx, sparsity=self.sparsity)
        self.isa = native.kernels_label()  # POWERINFER_ISA, set by the controller, lowers the CPU's best

    def prefill(self, ids: list[int]) -> None:
        self.llm.engine.release(0)
        self.llm.engine.prefill(0, ids)

    def decode(self, tokens: list[int]) -> None:
        engine = self.llm.engine
        engine.release(0)
        for token in tokens:
            engine.decode([(0, token)])

    def bytes_read(self, tokens: list[int]) -> float | None:
        """Weight bytes read per decoded token (greedy steps after the first token); None for a model
        whose FFNs are neuron records (their reads are not counted per linear)."""
        from powerinfer.errors import UnsupportedModelError

        try:
            return bytes_per_token(self.llm, tokens[:1], len(tokens) - 1)
        except UnsupportedModelError:
            return None


class PowerInferSparseWorker(PowerInferWorker):
    """A PowerInfer GGUF with predictors (each token computes only the predicted FFN neurons), or a
    `powerinfer sparsify` output (each linear skips its input's small channels)."""

    sparsity = "auto"


class LlamaCppWorker:
    """llama.cpp through its C API (llama_decode), without llama-cpp-python's per-token Python work."""

    def __init__(self, model: str, threads: int, n_ctx: int, isa: str):
        ensure_llama_cpp(isa)
        import llama_cpp

        self.lib = llama_cpp
        self.isa = llama_cpp_isa(llama_cpp)
        self.llm = llama_cpp.Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512, verbose=False)
        self.ctx = self.llm.ctx

    def _eval(self, ids: list[int]) -> None:
        tokens = (self.lib.llama_token * len(ids))(*ids)
        if self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(tokens, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def prefill(self, ids: list[int]) -> None:
        self._clear()
        self._eval(ids)

    def decode(self, tokens: list[int]) -> None:
        self._clear()
        for token in tokens:
            self._eval([token])
            self.lib.llama_get_logits_ith(self.ctx, -1)


class TransformersWorker:
    """transformers loading the same GGUF (it dequantizes to float32), with its KV cache."""

    def __init__(self, model: str, threads: int, n_ctx: int, isa: str):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.isa = torch.backends.cpu.get_cpu_capability().lower()
        path = Path(model)
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    def prefill(self, ids: list[int]) -> None:
        with self.torch.inference_mode():
            self.model(self.torch.tensor([ids]), use_cache=True)

    def decode(self, tokens: list[int]) -> None:
        from transformers import DynamicCache

        cache = DynamicCache()
        with self.torch.inference_mode():
            for token in tokens:
                self.model(self.torch.tensor([[token]]), past_key_values=cache, use_cache=True)


WORKERS = {"powerinfer": PowerInferWorker, "powerinfer-sparse": PowerInferSparseWorker, "llama.cpp": LlamaCppWorker,
           "transformers": TransformersWorker}


def worker_main(engine: str, model: str, threads: int, n_ctx: int, isa: str) -> None:
    """Load the engine, then answer timing requests read as JSON lines on stdin."""
    worker = WORKERS[engine](model, threads, n_ctx, isa)
    print(json.dumps({"ready": True, "isa": worker.isa}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["test"] == "bytes":
            bytes_read = worker.bytes_read(request["tokens"]) if hasattr(worker, "bytes_read") else None
            print(json.dumps({"bytes": bytes_read}), flush=True)
            continue
        started = time.perf_counter()
        if request["test"] == "pp":
            worker.prefill(request["ids"])
        else:
            worker.decode(request["tokens"])
        seconds = time.perf_counter() - started
        print(json.dumps({"seconds": seconds, "peak_rss": peak_rss()}), flush=True)


# ---------------------------------------------------------------- controller

class Engine:
    def __init__(self, name: str, model: str, threads: int, n_ctx: int, isa: str):
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", name, "--model", model, "--threads", str(threads), "--n-ctx", str(n_ctx),
             "--isa", isa],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **isa_environment(isa)})
        self.isa = self._read()["isa"]
        self.times: dict[str, list[float]] = {"pp": [], "tg": []}
        self.peak_rss = 0
        self.bytes_per_token: float | None = None

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited")
        return json.loads(line)

    def run(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self._read()
        if request["test"] == "bytes":
            self.bytes_per_token = reply["bytes"]
            return
        self.times[request["test"]].append(reply["seconds"])
        self.peak_rss = reply["peak_rss"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help=f"GGUF file, or one of {', '.join(MODEL_NAMES)} (default: smollm2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--engines", nargs="+", default=["powerinfer", "llama.cpp", "transformers"], choices=list(WORKERS))
    parser.add_argument("--sparse-model", help="PowerInfer GGUF with predictors for the powerinfer-sparse engine")
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--n-ctx", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--isa", choices=ISAS, help="instruction set of every engine (default: this CPU's best)")
    parser.add_argument("--out", type=Path, help="results file (default: by model, under benchmarks/results)")
    args = parser.parse_args()
    named = args.model
    args.model = str(benchmark_model(args.model))
    isa = args.isa or cpu_isa()
    if args.worker:
        worker_main(args.worker, args.model, args.threads, args.n_ctx, isa)
        return
    if "llama.cpp" in args.engines:
        ensure_llama_cpp(isa)

    if "powerinfer-sparse" in args.engines and not args.sparse_model:
        parser.error("the powerinfer-sparse engine needs --sparse-model")
    stem = "dense_engines" if named in (None, "smollm2") else f"dense_engines_{Path(args.model).stem}"
    default_out = RESULTS / f"{stem}{'' if isa == 'avx512' else '_' + isa}.md"
    out = args.out or default_out
    from powerinfer import LLM

    # Real text (wikitext-2 test), so that predictors see the kind of input they were trained for.
    text = wikitext("test.txt")[:200000]
    ids = LLM(args.model, n_ctx=64).tokenize(text, add_bos=False)[: args.n_prompt + args.n_gen]
    n_ctx = args.n_prompt + args.n_gen + 8
    engines = [Engine(name, args.sparse_model if name == "powerinfer-sparse" else args.model, args.threads, n_ctx, isa)
               for name in args.engines]
    requests = [{"test": "pp", "ids": ids[: args.n_prompt]}, {"test": "tg", "tokens": ids[args.n_prompt :]}]
    memory_before = memory_read_rate()
    for engine in engines:  # warm-up, not recorded
        for request in requests:
            engine.run(request)
            engine.times[request["test"]].clear()
    for rep in range(args.reps):
        for engine in interleaved(engines, rep):
            for request in requests:
                engine.run(request)
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    memory_after = memory_read_rate()
    for engine in engines:  # after the timings: counting selections slows a step down
        engine.run({"test": "bytes", "tokens": ids[args.n_prompt :]})
        engine.close()

    def rates(engine: Engine, test: str) -> list[float]:  # one per repetition, in order
        n = args.n_prompt if test == "pp" else args.n_gen
        return [n / s for s in engine.times[test]]

    def versus(engine: Engine, base: Engine | None, test: str) -> str:
        return f"{paired_ratio(rates(engine, test), rates(base, test))[0]:.2f}x" if base else ""

    reference = next((e for e in engines if e.name == "llama.cpp"), None)
    dense = next((e for e in engines if e.name == "powerinfer"), None) if args.sparse_model else None
    rows = [f"| engine | ISA | decode tg{args.n_gen} (tok/s) | prefill pp{args.n_prompt} (tok/s) | decode vs llama.cpp | "
            f"prefill vs llama.cpp |{' decode vs powerinfer |' if dense else ''} MB read per token | peak RSS (MiB) |",
            f"| --- | --- | ---: | ---: | ---: | ---: |{' ---: |' if dense else ''} ---: | ---: |"]
    for engine in engines:
        tg, pp = statistics.median(rates(engine, "tg")), statistics.median(rates(engine, "pp"))
        read = "" if engine.bytes_per_token is None else f"{engine.bytes_per_token / 1e6:.1f}"
        vs_dense = f" {versus(engine, dense, 'tg')} |" if dense else ""
        rows.append(f"| {engine.name} | {engine.isa} | {tg:.1f} | {pp:.1f} | {versus(engine, reference, 'tg')} | "
                    f"{versus(engine, reference, 'pp')} |{vs_dense} {read} | {engine.peak_rss / 2**20:.0f} |")
    table = "\n".join(rows)
    print(table)

    report = [
        "# Engines side by side" if args.sparse_model else "# Dense engines side by side",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine_description()}; memory read {memory_before} before",
        f"the timings, {memory_after} after.",
        f"Model: `{Path(args.model).name}`; {args.threads} threads; medians of {args.reps} interleaved repetitions",
        "(ABBA order, after one warm-up each); a ratio (vs) is the median of each repetition's ratio to the run",
        "beside it. Decode: tg = single-token steps from an empty cache over wikitext-2 test tokens;",
        "prefill: one batch of wikitext-2 test tokens from an empty cache. powerinfer-sparse: the file",
        f"`{Path(args.sparse_model).name if args.sparse_model else '-'}` (predictors, or a `sparsify` output) with `sparsity=\"auto\"`. llama.cpp runs through llama-cpp-python's C API",
        f"({LLAMA_CPP_PYTHON}, built from source here for {isa} alone: `{LLAMA_CPP_CMAKE_ARGS[isa]}`); transformers loads",
        "the same GGUF dequantized to float32. ISA: the instruction set each engine reported running. MB read per",
        "token (powerinfer engines): the block linears' and output head's weight bytes a decode step read (a sparse",
        "linear's active blocks' scales and active channels' runs), mean over greedy steps on the same tokens, counted",
        "after the timings.",
        "",
        table,
        "",
        f"Command: `.venv/bin/python benchmarks/compare_engines.py{f' --model {named}' if named else ''} "
        f"--threads {args.threads} --reps {args.reps}{f' --isa {args.isa}' if args.isa else ''} "
        f"--engines {' '.join(args.engines)}{' --sparse-model FILE' if args.sparse_model else ''}"
        f"{'' if out == default_out else f' --out {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}'}`",
        "",
        "Peak RSS: each worker's VmHWM (its own high-water mark since it started its program; with",
        "getrusage, a worker started by fork + exec also counted the controller's resident set).",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(report) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
