"""What the benchmarks share: the machine they ran on, the benchmark texts, and llama.cpp.

Results are only comparable on the same machine, so every results file names the CPU model, the
cores, the load and the accelerator. llama.cpp comes from llama-cpp-python built from source here;
built with its defaults (GGML_NATIVE) it segfaults in eval on Intel Xeons with AMX (in its AMX weight
buffers), so it is built with AVX-512 on and AMX off on every machine we use.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_CPP_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                        "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")
# WikiText-2 (CC BY-SA 3.0): valid.txt for calibration, test.txt for perplexity only.
WIKITEXT = Path(os.environ.get("POWERINFER_WIKITEXT", ROOT.parent / "shared" / "data" / "wikitext-2"))


# Models the benchmarks name (--model NAME): the default model, and a real K-quant file, Gemma 3
# 270M Q4_K_M, assembled from its PyPI parts on first use.
MODEL_NAMES = ("smollm2", "gemma3-270m")


def benchmark_model(name_or_path: str | None) -> Path:
    """The GGUF file `name_or_path` names: one of MODEL_NAMES (default: smollm2), or a path."""
    if name_or_path not in (None, *MODEL_NAMES):
        return Path(name_or_path)
    from powerinfer import hub  # not before: a benchmark's llama.cpp worker stays free of our imports

    if name_or_path == "gemma3-270m":
        return hub.pull_split_model(hub.GEMMA3_270M_Q4_K_M)
    return hub.pull_default_model()


def peak_rss() -> int:
    """This process's peak resident set (bytes) since it started its program: VmHWM, not
    getrusage's ru_maxrss, which a child started with fork + exec inherits from its parent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def wikitext(name: str) -> str:
    """The text of `valid.txt` or `test.txt` from $POWERINFER_WIKITEXT (default ../shared/data/wikitext-2)."""
    path = WIKITEXT / name
    if not path.is_file():
        sys.exit(f"benchmark text not found: {path} (set POWERINFER_WIKITEXT to a folder holding WikiText-2's "
                 "valid.txt and test.txt; see benchmarks/README.md)")
    return path.read_text()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """CPU model, cores, memory, accelerator, load and software versions, in one line."""
    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{cpu_model()}, {os.cpu_count()} logical cores, {memory:.0f} GiB, {gpu}; load average {load} at the "
            f"start; Python {platform.python_version()}, torch {torch.__version__}")


def memory_bandwidth(seconds: float = 1.0) -> float:
    """Read bandwidth (GB/s): summing a 512 MiB float32 array, median of repeats."""
    import statistics
    import time

    import torch

    data = torch.ones(128 << 20, dtype=torch.float32)
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds or len(times) < 3:
        t = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - t)
    return data.nbytes / statistics.median(times) / 1e9


def ensure_llama_cpp() -> None:
    """Install llama-cpp-python (built from source, AMX off) unless it is already there."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(f"installing {LLAMA_CPP_PYTHON} (compiles llama.cpp: several minutes) ...", file=sys.stderr)
        env = {**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS}
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-binary", "llama-cpp-python",
                        LLAMA_CPP_PYTHON], check=True, env=env)


# ---------------------------------------------------------------- perplexity (llama.cpp's method)

@dataclass
class Measured:
    """A perplexity and its standard error."""

    ppl: float
    error: float


def run_perplexity(logits_of: Callable[[], Callable], chunks, label: str, cache: Path | None) -> Measured:
    """Perplexity over `chunks` with the logits function `logits_of()` makes; with `cache`, a row
    measured before on the same chunks is read back (so a long run can be done in parts)."""
    from powerinfer.tools.perplexity import perplexity

    saved = None
    if cache is not None:
        digest = hashlib.sha256(json.dumps(chunks).encode()).hexdigest()[:16]
        saved = cache / f"{label.replace(' ', '_').replace('%', 'pct')}-{digest}.json"
        if saved.exists():
            print(f"{label}: measured before ({saved})", file=sys.stderr)
            return Measured(**json.loads(saved.read_text()))
    from tqdm import tqdm

    *_, result = tqdm(perplexity(logits_of(), chunks), total=len(chunks), desc=label, unit="chunk", file=sys.stderr)
    measured = Measured(result.ppl, result.error)
    if saved is not None:
        cache.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(asdict(measured)))
    return measured


def llama_cpp_logits(model: str, threads: int, n_ctx: int):
    """llama.cpp's logits of every position of a chunk of at most `n_ctx` tokens, as torch float32."""
    import llama_cpp
    import numpy as np
    import torch

    llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                          logits_all=True, verbose=False)

    def logits_of(ids: list[int]):
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))

    return logits_of
