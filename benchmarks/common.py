"""What the benchmarks share: the machine they ran on, the benchmark texts, and llama.cpp.

Results are only comparable on the same machine, so every results file names the CPU model, the
cores, the load and the accelerator. llama.cpp comes from llama-cpp-python built from source here;
built with its defaults (GGML_NATIVE) it segfaults in eval on Intel Xeons with AMX (in its AMX weight
buffers), so it is built with AVX-512 on and AMX off on every machine we use.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_CPP_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                        "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")
# WikiText-2 (CC BY-SA 3.0): valid.txt for calibration, test.txt for perplexity only.
WIKITEXT = Path(os.environ.get("POWERINFER_WIKITEXT", ROOT.parent / "shared" / "data" / "wikitext-2"))


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
