"""What the kernel benchmarks record about the machine they ran on."""

from __future__ import annotations

import platform
import statistics
import time

import torch


def cpu_model() -> str:
    with open("/proc/cpuinfo") as info:
        return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.processor())


def memory_bandwidth(seconds: float = 1.0) -> float:
    """Read bandwidth (GB/s): summing a 512 MiB float32 array, median of repeats."""
    data = torch.ones(128 << 20, dtype=torch.float32)
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < seconds or len(times) < 3:
        t = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - t)
    return data.nbytes / statistics.median(times) / 1e9
