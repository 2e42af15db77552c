"""Input-sparse linears on column records (powerinfer/sparse/columns.py) against the dense row
layout (QuantLinear), at Llama-2-7B widths.

    .venv/bin/python benchmarks/sparse_linear.py [--isa avx2] [--threads 2] [--rows 1 2 4]
        [--pairs Q4_0:Q4_0 Q4_K:Q4_K Q4_K:Q4_0] [--out FILE]

Per linear of a 7B block (q/k/v fused 4096 -> 12288, o 4096 -> 4096, gate/up fused 4096 -> 22016,
down 11008 -> 4096) and per pair of block types (the dense file's rows : the column records, e.g.
a Q4_K file's columns stored as Q4_0): the dense kernel, then the column layout at 0 %, 40 %, 50 %, 60 % and 70 % of the input
channels skipped (random x, one uniform threshold at that quantile of |x| per row of x; several rows
select different channels and compute their union). Weights are random blocks (the speed does not
depend on the values), copies of each linear rotating so that every call reads from memory, as in
decoding. Times are medians of repeated calls; "ratio" is dense time / column time, GB/s the bytes
a call reads (the dense matrix; the union of selected columns) per second. "block" sums the four
linears: the decode-time ratio of a block's weights. Also: the error of re-quantizing a row-quantized
matrix's columns (what a sparsified file stores), as the relative Frobenius error of the product
against the source matrix's, and the bytes per weight of each type. Results: benchmarks/results/sparse_linear_<isa>.md.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from powerinfer.convert.kquants import K_QUANT_TYPES, quantize_k
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.linear import build_linear
from powerinfer.ops.quant import dequantize_rows, random_blocks, row_bytes
from powerinfer.sparse.columns import transpose_quantize
from powerinfer.sparse.payoff import median_seconds, random_column_linear

from common import machine_description, memory_bandwidth

# (name, in, outputs of each fused matrix)
LINEARS = [("qkv", 4096, (4096, 4096, 4096)), ("o", 4096, (4096,)), ("gate/up", 4096, (11008, 11008)),
           ("down", 11008, (4096,))]
SPARSITIES = (0.0, 0.4, 0.5, 0.6, 0.7)
ERROR_COLUMN_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_1, T.Q8_0)  # re-quantization error and bytes of each
FROM_MEMORY_BYTES = 160 << 20  # copies of a linear rotate until they hold this much (5x this L3)
RESULTS = Path(__file__).parent / "results"


def requantization_error(row_type: T, column_type: T, out_features: int, in_features: int, rng) -> tuple[float, float]:
    """(||x (C - S)|| / ||x S||, ||x (S - W)|| / ||x W||) for W a float matrix, S it quantized by rows
    in `row_type` (the source file's) and C the columns of S re-quantized in `column_type`, x
    Gaussian rows: the column layout's added error, beside the source file's own."""
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.02
    w[rng.random(w.shape) < 0.01] *= 8
    quantize = quantize_k if row_type in K_QUANT_TYPES else quants.quantize
    source = dequantize_rows(torch.from_numpy(quantize(w, row_type)), row_type, in_features)
    columns = transpose_quantize(source, column_type).dequantized().T
    x = torch.from_numpy(rng.standard_normal((64, in_features)).astype(np.float32))
    relative = lambda a, b: float(torch.linalg.norm(x @ (a - b).T) / torch.linalg.norm(x @ b.T))  # noqa: E731
    return relative(columns, source), relative(source, torch.from_numpy(w))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", help="instruction set (default: the CPU's best)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--pairs", nargs="+", default=["Q4_0:Q4_0", "Q4_K:Q4_K", "Q4_K:Q4_0", "Q4_K:Q4_1"],
                        help="ROWS:COLUMNS block types: the dense file's, the column records'")
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
    isa = args.isa or ops.detected_isa()
    ops.set_isa(isa)
    torch.set_num_threads(args.threads)
    machine, bandwidth = machine_description(), memory_bandwidth()
    rng = np.random.default_rng(0)
    header = "| linear | rows:columns | rows | dense ms | dense GB/s | " + " | ".join(f"{s:.0%} skipped: ratio (GB/s)" for s in SPARSITIES) + " |"
    lines = [header, "|" + " --- |" * (5 + len(SPARSITIES))]
    errors = []
    for pair in args.pairs:
        row_name, column_name = pair.split(":")
        ggml_type, column_type = T[row_name], T[column_name]
        block_seconds: dict[int, list[float]] = {}  # rows -> summed seconds: dense, then each sparsity
        for name, in_features, outputs in LINEARS:
            out_features = sum(outputs)
            dense_bytes = out_features * row_bytes(ggml_type, in_features)
            copies = max(2, -(-FROM_MEMORY_BYTES // dense_bytes))
            dense = [build_linear([GGUFTensor("w", ggml_type, (out_features, in_features),
                                              random_blocks(ggml_type, out_features, in_features, rng))]) for _ in range(copies)]
            columns = [random_column_linear(in_features, [(column_type, out) for out in outputs], rng)
                       for _ in range(copies)]
            record_bytes = columns[0].nbytes // in_features
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
                    union = int(((x.abs() > level).any(dim=0)).sum())
                    cells.append(f"{dense_s / s:.2f}x ({union * record_bytes / s / 1e9:.1f})")
                    sums.append(s)
                block_seconds.setdefault(rows, [0.0] * len(sums))
                block_seconds[rows] = [a + b for a, b in zip(block_seconds[rows], sums)]
                row = (f"| {name} {in_features}->{out_features} | {pair} | {rows} | {dense_s * 1e3:.3f} | "
                       f"{dense_bytes / dense_s / 1e9:.1f} | " + " | ".join(cells) + " |")
                print(row, flush=True)
                lines.append(row)
            del dense, columns
        for rows, sums in block_seconds.items():
            row = (f"| **block** (4 linears) | {pair} | {rows} | {sums[0] * 1e3:.3f} | | "
                   + " | ".join(f"**{sums[0] / s:.2f}x**" for s in sums[1:]) + " |")
            print(row, flush=True)
            lines.append(row)
    for row_name in dict.fromkeys(pair.split(":")[0] for pair in args.pairs):
        for column_type in ERROR_COLUMN_TYPES:
            added, own = requantization_error(T[row_name], column_type, 2048, 2048, rng)
            errors.append(f"| {row_name} | {own:.4f} | {column_type.name} | {row_bytes(column_type, 4096) / 4096:.4f} | {added:.4f} |")
    out = args.out or RESULTS / f"sparse_linear_{isa}.md"
    out.write_text(
        f"# Input-sparse linears on column records vs the dense row layout, Llama-2-7B widths\n\n"
        f"Measured {datetime.date.today()} on {machine}; {isa} kernels, {args.threads} threads, {args.clock} clock; memory read bandwidth "
        f"measured in the same run: {bandwidth:.1f} GB/s. Dense: QuantLinear on the type's rows; columns: "
        "SparseInputProjection on records of the pair's column type; ratio = dense time / column time (higher: the "
        "column layout is faster); GB/s: bytes read per second (dense: the matrix; columns: the union of the "
        "rows' selected columns). Weights from memory (copies rotate).\n\n" + "\n".join(lines) +
        "\n\nRe-quantization error of the column records: a 2048 x 2048 Gaussian matrix (1 % outliers) quantized by "
        "rows (the source file; its own error against the float matrix beside it), its columns quantized again; "
        "relative Frobenius error of the product with Gaussian x against the source's product.\n\n"
        "| rows | rows' error vs float | columns | column bytes/weight | columns' error vs rows |\n"
        "| --- | --- | --- | --- | --- |\n"
        + "\n".join(errors) +
        f"\n\nCommand: `.venv/bin/python benchmarks/sparse_linear.py --isa {isa} --threads {args.threads} "
        f"--rows {' '.join(map(str, args.rows))} --pairs {' '.join(args.pairs)} --clock {args.clock}`\n")
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s; wrote {out}")


if __name__ == "__main__":
    main()
