"""The placement solver on 7B, 13B and 70B llama shapes with synthetic power-law activation counts.

    .venv/bin/python benchmarks/solver.py [--time-limit 20] [--no-compare]

Q4_0 PowerInfer files: a neuron is its gate, up and down_t rows of n_embd values (18 bytes per 32).
Counts: per layer, neuron firing probabilities p(r) = min(1, c (r/n_ff)^-a) over the neurons' rank
r, with a ~ 0.83 so that about a quarter of the neurons cover 80 % of the activations (as reported
for ReLU OPT-30B) and c setting how many fire per token (about 7 %; 1 % for a very sparse 70B row),
both varied per layer; 10 000 calibration tokens drawn binomially; neuron ids shuffled. Budgets are bytes for neurons (a
share of the FFN weights). Speeds: the cost model's defaults (CPU 24 GB/s, accelerator 700 GB/s,
30 us per split layer). Times both integer-program formulations; writes benchmarks/results/solver.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import numpy as np

from powerinfer.placement.costs import GiB, ModelShape, Speeds, measure_cpu_bandwidth
from powerinfer.placement.solver import plan_from_counts

from common import cpu_model

CASES = [("7B", 32, 11008, 4096, 0.1), ("13B", 40, 13824, 5120, 0.1), ("70B", 80, 28672, 8192, 0.1),
         ("70B sparse", 80, 28672, 8192, 0.015)]  # name, layers, n_ff, n_embd, firing scale
SHARES = (0.1, 0.25, 0.5)
TOKENS = 10_000
OUT = Path(__file__).parent / "results" / "solver.md"


def firing_probabilities(n_ff: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    """One layer's neuron firing probabilities, hottest first: p(r) = min(1, c (r/n_ff)^-a)."""
    rank = (np.arange(n_ff) + 1) / n_ff
    a = rng.uniform(0.78, 0.88)
    c = scale * (1 - a) * rng.uniform(0.5, 1.5)
    return np.minimum(1.0, c * rank ** -a)


def synthetic_counts(n_layers: int, n_ff: int, scale: float, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.binomial(TOKENS, firing_probabilities(n_ff, scale, rng))[rng.permutation(n_ff)] for _ in range(n_layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per solve (default: 20)")
    parser.add_argument("--no-compare", action="store_true", help="time the default formulation only")
    args = parser.parse_args()
    formulations = ("groups",) if args.no_compare else ("groups", "cumulative")
    import scipy.optimize  # noqa: F401 - imported before the clock starts

    rng = np.random.default_rng(0)
    rows = []
    for name, n_layers, n_ff, n_embd, scale in CASES:
        counts = synthetic_counts(n_layers, n_ff, scale, rng)
        shape = ModelShape((n_ff,) * n_layers, (3 * n_embd // 32 * 18,) * n_layers)
        active = np.mean([c.sum() / (TOKENS * n_ff) for c in counts])
        for share in SHARES:
            budget = int(share * shape.ffn_bytes)
            for formulation in formulations:
                plan = plan_from_counts(counts, TOKENS, shape, budget, Speeds(), formulation=formulation,
                                        time_limit=args.time_limit)
                row = (f"| {name} ({n_layers}x{n_ff}, {active:.0%} active) | {budget / GiB:.2f} ({share:.0%}) | "
                       f"{formulation} | {plan.solve_seconds:.2f}{'' if plan.optimal else ' (limit)'} | "
                       f"{len(plan.split_layers)}/{n_layers} | {sum(len(h) for h in plan.hot) / sum(shape.n_ff):.1%} | "
                       f"{plan.served_share:.1%} | {plan.seconds_per_token * 1e3:.2f} | "
                       f"{plan.cpu_seconds_per_token * 1e3:.2f} |")
                print(row, flush=True)
                rows.append(row)
    bandwidth = measure_cpu_bandwidth() / 1e9
    header = [
        "# Placement solver (scipy.optimize.milp / HiGHS)",
        "",
        f"Measured {datetime.date.today().isoformat()} on {cpu_model()} ({os.cpu_count()} cores visible, shared "
        f"with other work; CPU read bandwidth measured in the same run: {bandwidth:.1f} GB/s), HiGHS presolve off",
        "for \"groups\" and on for \"cumulative\" (see `solve_counts`),",
        f"time limit {args.time_limit:g} s per solve (\"(limit)\": stopped there with the best plan found).",
        "Synthetic power-law counts and Q4_0 neuron sizes (see benchmarks/solver.py); the cost model's default",
        "speeds (CPU 24 GB/s, accelerator 700 GB/s, 30 us per layer that uses the accelerator).",
        "Solve time includes sorting the counts and building the program. \"FFN ms/token\" is the cost",
        "model's estimate with the plan; \"CPU only\" the same with every neuron on the CPU.",
        "",
        "| model | neuron budget GiB (of FFN) | formulation | solve s | split layers | neurons on accel "
        "| activations served | FFN ms/token | CPU only |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    footer = ["", f"Command: `.venv/bin/python benchmarks/solver.py --time-limit {args.time_limit:g}"
                  f"{' --no-compare' if args.no_compare else ''}`"]
    OUT.write_text("\n".join(header + rows + footer) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
