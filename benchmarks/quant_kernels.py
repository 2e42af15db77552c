"""QuantLinear's kernels per GGML block type and instruction set, on a 11008 x 4096 layer (a 7B
llama FFN projection), against what runs without them.

    .venv/bin/python benchmarks/quant_kernels.py [--threads 2] [--rows 1 8] [--isa avx512 avx2] [--types Q6_K ...] [--out FILE]

Paths: ours on each instruction set this CPU has (forced as POWERINFER_ISA does); "no native":
what `build_linear` makes without our module (torch's int4 kernel for Q4_0, Q4_1 and Q8_0, the
weights expanded to bfloat16 and torch's matmul for the rest). Weights are random blocks
(`ops.quant.random_blocks`; the speed does not depend on the values), several layers rotate so
that they come from memory, as in decoding. GB/s counts the file's bytes of the layer per call
(what a token has to read), medians of repeated calls; the memory read bandwidth is measured in
the same run: the roofline a 1-row kernel can reach. Results: benchmarks/results/quant_kernels.md
on an AVX-512 CPU, quant_kernels_avx2.md on an AVX2-only one.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.linear import build_linear
from powerinfer.ops.quant import BLOCK_TYPES, random_blocks

from common import ISAS, machine_description, memory_bandwidth

OUT_FEATURES, IN_FEATURES, LAYERS = 11008, 4096, 3
CACHED = (1024, 2048)  # a layer that stays in cache: the kernels' arithmetic speed, not the memory's
RESULTS = Path(__file__).parent / "results"


def median_seconds(layers, x: torch.Tensor, min_seconds: float = 0.5) -> float:
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < min_seconds or len(times) < 2 * len(layers):
        layer = layers[len(times) % len(layers)]
        t = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of x per call (tokens sharing a step)")
    parser.add_argument("--isa", nargs="+", choices=[*ISAS, "avx2+vnni", "scalar"],
                        help="instruction sets to measure (default: every one this CPU has)")
    parser.add_argument("--types", nargs="+", choices=[T(t).name for t in sorted(BLOCK_TYPES)],
                        help="block types to measure (default: every one)")
    parser.add_argument("--out", type=Path, help="results file (default: by the CPU's best instruction set)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native.load() is None:
        raise SystemExit("native operators are unavailable: nothing to benchmark")
    isas = [isa for isa in native.kernel_paths() if not args.isa or isa in args.isa]
    if not isas:
        raise SystemExit(f"this CPU has none of {' '.join(args.isa)} (it has {' '.join(native.kernel_paths())})")
    machine, bandwidth = machine_description(), memory_bandwidth()
    rng = np.random.default_rng(0)
    types = sorted(BLOCK_TYPES) if not args.types else [T[name].value for name in args.types]
    out = args.out or RESULTS / f"quant_kernels{'' if isas[0] == 'avx512' else '_' + isas[0]}.md"
    header = "| type | bytes/weight | " + " | ".join(f"{p}, {m} row{'s' * (m > 1)}" for m in args.rows for p in [*isas, "no native"])
    header += " | " + " | ".join(f"{p}, in cache" for p in isas) + " |"
    lines = [header, "|" + " --- |" * (2 + len(args.rows) * (len(isas) + 1) + len(isas))]
    for ggml_type in types:
        tensors = [GGUFTensor("w", ggml_type, (OUT_FEATURES, IN_FEATURES), random_blocks(ggml_type, OUT_FEATURES, IN_FEATURES, rng))
                   for _ in range(LAYERS)]
        file_bytes = tensors[0].data.nbytes
        ours = [build_linear([t]) for t in tensors]
        with mock.patch("powerinfer.ops.linear.quant_kernel", lambda: None):
            fallback = [build_linear([t]) for t in tensors]
        cells = []
        for m in args.rows:
            x = torch.randn(m, IN_FEATURES)
            for isa in isas:
                with native.kernel_path(isa):
                    seconds = median_seconds(ours, x)
                cells.append(f"{file_bytes / seconds / 1e9:.1f}")
            cells.append(f"{file_bytes / median_seconds(fallback, x) / 1e9:.1f}")
        cached = build_linear([GGUFTensor("w", ggml_type, CACHED, random_blocks(ggml_type, *CACHED, rng))])
        for isa in isas:
            with native.kernel_path(isa):
                cells.append(f"{cached.nbytes / median_seconds([cached], torch.randn(1, CACHED[1])) / 1e9:.1f}")
        row = f"| {T(ggml_type).name} | {file_bytes / (OUT_FEATURES * IN_FEATURES):.4f} | " + " | ".join(cells) + " |"
        print(row, flush=True)
        lines.append(row)
    note = (f"# QuantLinear kernels: GB/s of file bytes per call ({OUT_FEATURES} x {IN_FEATURES} layer)\n\n"
            f"Measured {datetime.date.today()} on {machine}; {args.threads} threads; memory read bandwidth "
            f"measured in the same run: {bandwidth:.1f} GB/s. Columns: our kernel on each instruction set, and "
            "\"no native\" (torch's int4 kernel for Q4_0/Q4_1/Q8_0, bfloat16-expanded weights for the rest); "
            "per number of rows of x sharing a call (GB/s of the layer's bytes per call, so with 8 rows 8 "
            f"tokens' worth of work); and, at 1 row, each instruction set on a {CACHED[0]} x {CACHED[1]} layer that "
            "stays in cache (the arithmetic's speed, not the memory's: least disturbed by other processes). "
            "Higher is faster; at 1 row a kernel at the memory roofline reaches the measured bandwidth.\n\n" + "\n".join(lines) +
            f"\n\nCommand: `.venv/bin/python benchmarks/quant_kernels.py --threads {args.threads} --rows {' '.join(map(str, args.rows))}"
            f"{' --isa ' + ' '.join(args.isa) if args.isa else ''}{' --types ' + ' '.join(args.types) if args.types else ''}`\n")
    out.write_text(note)
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s; wrote {out}")


if __name__ == "__main__":
    main()
