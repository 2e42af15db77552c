"""Input-sparse linears on channel runs (powerinfer/sparse/columns.py) against the dense row
layout (QuantLinear), at Llama-2-7B widths.

    .venv/bin/python benchmarks/sparse_linear.py [--isa avx2] [--threads 2] [--rows 1 2]
        [--types Q4_0 Q4_K Q8_0] [--out FILE]

Per linear of a 7B block (q/k/v fused 4096 -> 12288, o 4096 -> 4096, gate/up fused 4096 -> 22016,
down 11008 -> 4096) and per block type: the dense kernel on the rows, then the same rows regrouped
into channel runs at 0 %, 40 %, 50 %, 60 % and 70 % of the input channels skipped (random x, one
uniform threshold at that quantile of |x| per row of x). Weights are random blocks (the speed does
not depend on the values), copies of each linear rotating so that every call reads from memory, as
in decoding. Times are medians of repeated calls; "ratio" is dense time / sparse time, GB/s the
bytes a call reads (the dense matrix; the selected channels' runs and the scales of their blocks,
as the layer counts them) per second. "block" sums the four linears: the decode-time ratio of a block's weights. Results:
benchmarks/results/sparse_linear_<isa>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.linear import build_linear
from powerinfer.ops.quant import random_blocks, row_bytes
from powerinfer.sparse.payoff import median_seconds, random_column_linear

from common import machine_description, memory_bandwidth

# (name, in, outputs of each fused matrix)
LINEARS = [("qkv", 4096, (4096, 4096, 4096)), ("o", 4096, (4096,)), ("gate/up", 4096, (11008, 11008)),
           ("down", 11008, (4096,))]
SPARSITIES = (0.0, 0.4, 0.5, 0.6, 0.7)
FROM_MEMORY_BYTES = 160 << 20  # copies of a linear rotate until they hold this much (5x this L3)
RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", help="kernel path: avx512, avx2+vnni, avx2 or scalar (default: what the engine runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K", "Q8_0"], help="the rows' block types")
    parser.add_argument("--seconds", type=float, default=0.4, help="minimum time per measurement")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: this thread's CPU time (with --threads 1: immune to time slices lost to other "
                             "processes on a shared machine; memory stalls still count)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures one thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    ops = native.load()
    if ops is None:
        raise SystemExit("native operators are unavailable: nothing to benchmark")
    # --isa: "avx2" is plain AVX2, as CPUs without AVX-VNNI run it; "avx512" has QuantLinear's bfloat16 kernel.
    # Without it, what the engine runs (on Intel's AVX-512 CPUs QuantLinear's integer kernels with AVX-VNNI:
    # forcing "avx512" there times the dense rows on the slower bfloat16 kernel).
    with native.kernel_path(args.isa) if args.isa else contextlib.nullcontext():
        measure(args, clock, args.isa or ops.isa())


def measure(args: argparse.Namespace, clock: Callable[[], float], isa: str) -> None:
    """Times every linear and type of `args`, writes the table."""
    kernels = native.kernels_label()
    torch.set_num_threads(args.threads)
    machine, bandwidth = machine_description(), memory_bandwidth()
    rng = np.random.default_rng(0)
    header = "| linear | type | rows | dense ms | dense GB/s | " + " | ".join(f"{s:.0%} skipped: ratio (GB/s)" for s in SPARSITIES) + " |"
    lines = [header, "|" + " --- |" * (5 + len(SPARSITIES))]
    for type_name in args.types:
        ggml_type = T[type_name]
        block_seconds: dict[int, list[float]] = {}  # rows -> summed seconds: dense, then each sparsity
        for name, in_features, outputs in LINEARS:
            out_features = sum(outputs)
            dense_bytes = out_features * row_bytes(ggml_type, in_features)
            copies = max(2, -(-FROM_MEMORY_BYTES // dense_bytes))
            dense = [build_linear([GGUFTensor("w", ggml_type, (out_features, in_features),
                                              random_blocks(ggml_type, out_features, in_features, rng))]) for _ in range(copies)]
            columns = [random_column_linear(in_features, [(ggml_type, out) for out in outputs], rng)
                       for _ in range(copies)]
            for rows in args.rows:
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                dense_s = median_seconds(dense, x, args.seconds, clock)
                cells, sums = [], [dense_s]
                for sparsity in SPARSITIES:
                    # one uniform threshold per row's quantile; several rows: the smallest (each row
                    # then skips about `sparsity`, through per-channel thresholds all equal)
                    level = float(torch.quantile(x.abs(), sparsity, dim=1).min()) if sparsity else 0.0
                    for layer in columns:
                        layer.thresholds.fill_(level)
                    s = median_seconds(columns, x, args.seconds, clock)
                    # what a call read (every copy took the same x): the active blocks' scales, the union's runs
                    cells.append(f"{dense_s / s:.2f}x ({columns[0].last_bytes_read / s / 1e9:.1f})")
                    sums.append(s)
                block_seconds.setdefault(rows, [0.0] * len(sums))
                block_seconds[rows] = [a + b for a, b in zip(block_seconds[rows], sums)]
                row = (f"| {name} {in_features}->{out_features} | {type_name} | {rows} | {dense_s * 1e3:.3f} | "
                       f"{dense_bytes / dense_s / 1e9:.1f} | " + " | ".join(cells) + " |")
                print(row, flush=True)
                lines.append(row)
            del dense, columns
        for rows, sums in block_seconds.items():
            row = (f"| **block** (4 linears) | {type_name} | {rows} | {sums[0] * 1e3:.3f} | | "
                   + " | ".join(f"**{sums[0] / s:.2f}x**" for s in sums[1:]) + " |")
            print(row, flush=True)
            lines.append(row)
    out = args.out or RESULTS / f"sparse_linear_{isa}.md"
    out.write_text(
        f"# Input-sparse linears on channel runs vs the dense row layout, Llama-2-7B widths\n\n"
        f"Measured {datetime.date.today()} on {machine}; kernels {kernels}, {args.threads} threads, {args.clock} clock; memory read bandwidth "
        f"measured in the same run: {bandwidth:.1f} GB/s. Dense: QuantLinear on the type's rows; sparse: "
        "SparseInputProjection on the same rows regrouped into channel runs; ratio = dense time / sparse time "
        "(higher: skipping is faster); GB/s: bytes read per second (dense: the matrix; sparse: the runs of the union "
        "of the rows' selected channels and the scales of their blocks). Weights from memory (copies rotate).\n\n"
        + "\n".join(lines) +
        f"\n\nCommand: `.venv/bin/python benchmarks/sparse_linear.py{f' --isa {args.isa}' if args.isa else ''} --threads {args.threads} "
        f"--rows {' '.join(map(str, args.rows))} --types {' '.join(args.types)} --clock {args.clock}`\n")
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s; wrote {out}")


if __name__ == "__main__":
    main()
