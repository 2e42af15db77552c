"""`powerinfer place`: solve the neuron placement for a VRAM budget and print it (writes only with -o)."""

from __future__ import annotations

import argparse
import sys

from powerinfer.commands.files import add_force_option
from powerinfer.commands.model_flags import add_model_source, model_path
from powerinfer.commands.parsing import OneLineParser, command_parser, non_negative_float, positive_float, positive_int
from powerinfer.gguf.reader import open_gguf
from powerinfer.models import read_config
from powerinfer.options import DEFAULT_N_CTX, context_size
from powerinfer.outputs import check_output_file
from powerinfer.placement.costs import GiB, Speeds, dense_parts, measure_cpu_bandwidth, model_shape
from powerinfer.placement.gpu_index import index_path, write_gpu_index
from powerinfer.placement.planner import load_statistics, place_dense, plan_table, stderr_note
from powerinfer.placement.solver import plan_from_counts

DEFAULT_CPU_BANDWIDTH = 24.0  # GB/s: a desktop's dual-channel DDR4


def build_parser() -> OneLineParser:
    parser = command_parser("place")
    add_model_source(parser, required=True)
    parser.add_argument("--vram-budget", type=non_negative_float, required=True, metavar="GB", help="accelerator memory in GiB")
    parser.add_argument("--activations", metavar="DIR", help="activation statistics (default: activation/ next to the model)")
    parser.add_argument("-c", "--ctx-size", type=positive_int,
                        help=f"context the KV cache is sized for (default: min({DEFAULT_N_CTX}, training context))")
    parser.add_argument("-o", "--write-index", nargs="?", const="", metavar="PATH",
                        help="write the GPU index (default path: <model>.generated.gpuidx); without it nothing is written")
    parser.add_argument("--group-size", type=positive_int, default=64, help="neurons placed together (default: %(default)s)")
    cpu = parser.add_mutually_exclusive_group()
    cpu.add_argument("--cpu-bandwidth", type=positive_float, default=DEFAULT_CPU_BANDWIDTH, metavar="GB/s",
                     help="CPU memory bandwidth (default: %(default)g)")
    cpu.add_argument("--measure", action="store_true", help="measure this machine's CPU memory bandwidth instead")
    parser.add_argument("--accelerator-bandwidth", type=positive_float, default=700.0, metavar="GB/s",
                        help="default: %(default)g")
    parser.add_argument("--sync-us", type=non_negative_float, default=30.0,
                        help="per-layer round trip in microseconds (default: %(default)g)")
    add_force_option(parser)
    return parser


def main(args: argparse.Namespace) -> int:
    model = model_path(args)
    gguf = open_gguf(model)
    output = None
    if args.write_index is not None:
        output = check_output_file(args.write_index or index_path(model), args.force)
    config = read_config(gguf)
    n_ctx = context_size(args.ctx_size, config.n_ctx_train)
    shape = model_shape(gguf, config, "cuda")
    cpu_bandwidth = measure_cpu_bandwidth() if args.measure else args.cpu_bandwidth * 1e9
    speeds = Speeds(cpu_bandwidth, args.accelerator_bandwidth * 1e9, args.sync_us * 1e-6)
    parts = dense_parts(gguf, config, n_ctx)
    budget = int(args.vram_budget * GiB)
    dense = place_dense(parts, budget)
    statistics = load_statistics(model, shape, args.activations, stderr_note)
    plan = plan_from_counts(statistics.counts, statistics.tokens, shape, budget - dense.bytes_used, speeds,
                            args.group_size)
    print(plan_table(plan, statistics, shape))
    print(f"model: {config.n_layers} layers x {max(shape.n_ff)} neurons, {shape.neuron_bytes[0]} bytes per neuron "
          f"on CUDA, FFN {shape.ffn_bytes / GiB:.2f} GiB; statistics: {statistics.source} ({statistics.tokens} tokens)")
    print(f"budget: {args.vram_budget:g} GiB; dense parts (attention, norms, predictors, KV cache for {n_ctx} tokens, "
          f"output head) {parts.total / GiB:.3f} GiB, of which on the accelerator: {dense.summary(config.n_layers)}; "
          f"{plan.capacity / GiB:.3f} GiB left for neurons")
    print(f"speeds: CPU {speeds.cpu_bandwidth / 1e9:.1f} GB/s{' (measured)' if args.measure else ''}, "
          f"accelerator {speeds.accelerator_bandwidth / 1e9:.0f} GB/s, sync {speeds.sync_seconds * 1e6:.0f} us/layer")
    print(f"plan: {plan.summary()}; split layers: {_ranges(plan.split_layers)}")
    if output is not None:
        write_gpu_index(output, plan, replace=args.force)
        print(f"wrote {output}", file=sys.stderr)
    return 0


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    if not layers:
        return "none"
    spans, start, previous = [], layers[0], layers[0]
    for layer in layers[1:]:
        if layer != previous + 1:
            spans.append((start, previous))
            start = layer
        previous = layer
    spans.append((start, previous))
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
