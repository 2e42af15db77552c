"""Which neurons go to the accelerator: an integer program solved with HiGHS (`scipy.optimize.milp`).

Cost model, per token and per layer l (neurons sorted by activation count, hottest first, taken in
groups of `group_size`; the accelerator holds a prefix of n_l groups):
  served_l  = expected activations per token of those groups (from the calibration counts)
  cpu_l     = (all_l - served_l) * bytes_per_neuron / cpu_bandwidth     cold neurons that fire
  acc_l     = served_l * bytes_per_neuron / accelerator_bandwidth      hot neurons that fire
  time_l    = cpu_l + acc_l + sync * [n_l > 0]
minimise sum_l time_l subject to sum_l bytes(n_l) <= budget. The sync term makes a layer worth
splitting only when its hot share saves more CPU time than the round trip costs. The two sides
overlap in reality (time ~ max(cpu, acc)); adding acc_l instead is a small pessimism (acc_l is a few
percent of what the same activations cost on the CPU) that keeps the objective decreasing in
served_l, which is what makes the compact formulation below exact.

Two formulations give the same optimum (tests check both against brute force):
  "cumulative": one integer n_l per layer; served_l is the concave prefix sum of sorted group values,
      linearised exactly by its tangents (served_l <= P(k) + v_k (n_l - k) for every k): few
      columns, one two-entry row per group.
  "groups": one binary per group with x_{l,k+1} <= x_{l,k} (PowerInfer's formulation plus the order).
benchmarks/solver.py times both (results/solver.md). "groups" is the default: with HiGHS's presolve
off it solves 70B-shaped instances in 1-1.5 s; "cumulative" needs presolve to be trusted (see
solve_counts) and then takes 2-6 s (without presolve one very sparse 70B took over 100 s). It stays
for re-measuring the choice.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from powerinfer.errors import PowerInferError
from powerinfer.placement.costs import ModelShape, Speeds

Formulation = Literal["cumulative", "groups"]
DEFAULT_GROUP_SIZE = 64
# The program counts time in microseconds and bytes in KiB: rows stay well scaled, and HiGHS's
# feasibility tolerances (1e-7 to 1e-6, absolute) are a thousandth of a byte, so a plan it accepts is
# within the budget to the byte (in MiB, a plan one byte over was accepted).
TIME_UNIT = 1e-6
BYTE_UNIT = 1 << 10
MiB = 1 << 20
DEFAULT_TIME_LIMIT = 60.0  # seconds; past it the best plan found so far is used


@dataclass(frozen=True)
class LayerGroups:
    """One layer's neurons sorted hottest first, cut into groups."""

    order: np.ndarray  # neuron ids, hottest first
    sizes: np.ndarray  # neurons per group
    values: np.ndarray  # expected activations per token of each group (non-increasing)

    @property
    def n_groups(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> float:
        return float(self.values.sum())


def layer_groups(counts: torch.Tensor | np.ndarray, tokens: int, group_size: int) -> LayerGroups:
    counts = np.asarray(counts, dtype=np.float64).ravel()
    order = np.lexsort((np.arange(len(counts)), -counts))  # hottest first, ties by id: deterministic
    starts = np.arange(0, len(counts), group_size)
    values = np.add.reduceat(counts[order], starts) / max(tokens, 1) if len(counts) else np.zeros(0)
    sizes = np.diff(np.append(starts, len(counts)))
    return LayerGroups(order, sizes, values)


@dataclass(frozen=True)
class Problem:
    layers: tuple[LayerGroups, ...]
    neuron_bytes: tuple[int, ...]
    budget: int  # bytes for neurons
    speeds: Speeds

    def gain(self, layer: int) -> float:
        """Seconds saved per token for each activation served by the accelerator instead of the CPU."""
        s = self.speeds
        return self.neuron_bytes[layer] * (1 / s.cpu_bandwidth - 1 / s.accelerator_bandwidth)

    def layer_time(self, layer: int, n_groups: int) -> float:
        """Seconds per token of one layer's FFN with its first `n_groups` groups on the accelerator."""
        g, b, s = self.layers[layer], self.neuron_bytes[layer], self.speeds
        served = float(g.values[:n_groups].sum())
        cpu, acc = (g.total - served) * b / s.cpu_bandwidth, served * b / s.accelerator_bandwidth
        return cpu + acc + (s.sync_seconds if n_groups > 0 else 0.0)

    def bytes_of(self, layer: int, n_groups: int) -> int:
        return int(self.layers[layer].sizes[:n_groups].sum()) * self.neuron_bytes[layer]


@dataclass(frozen=True)
class Plan:
    """Neurons on the accelerator per layer (sorted ids) and what the cost model expects of them."""

    hot: tuple[np.ndarray, ...]  # int32 sorted neuron ids per layer
    n_ff: tuple[int, ...]
    bytes_used: int
    capacity: int  # the neuron budget the plan was made for (bytes)
    served_share: float | None  # expected share of activations computed on the accelerator
    seconds_per_token: float | None  # the cost model's FFN time per token
    cpu_seconds_per_token: float | None  # the same with everything on the CPU
    solve_seconds: float | None
    optimal: bool | None = None  # False: the solver's time limit ran out first

    @property
    def split_layers(self) -> list[int]:
        return [i for i, h in enumerate(self.hot) if len(h) > 0]

    def summary(self) -> str:
        parts = [f"{len(self.split_layers)}/{len(self.hot)} layers use the accelerator",
                 f"{sum(len(h) for h in self.hot)}/{sum(self.n_ff)} neurons",
                 f"{self.bytes_used / MiB:.1f} MiB of {self.capacity / MiB:.1f} MiB for neurons"]
        if self.served_share is not None:
            parts.append(f"{100 * self.served_share:.1f}% of activations served there")
        if self.seconds_per_token is not None and self.cpu_seconds_per_token:
            parts.append(f"FFN {self.seconds_per_token * 1e3:.2f} ms/token (CPU only "
                         f"{self.cpu_seconds_per_token * 1e3:.2f})")
        if self.solve_seconds is not None:
            parts.append(f"solved in {self.solve_seconds:.2f} s" + (" (time limit: not proven optimal)"
                                                                     if self.optimal is False else ""))
        return ", ".join(parts)


class _Rows:
    """A sparse constraint matrix built row by row."""

    def __init__(self):
        self.rows, self.columns, self.data, self.lo, self.hi = [], [], [], [], []

    def add(self, entries, lo: float, hi: float) -> None:
        for column, value in entries:
            self.rows.append(len(self.lo)), self.columns.append(column), self.data.append(value)
        self.lo.append(lo), self.hi.append(hi)


def _cumulative(problem: Problem):
    """Columns per layer: n (integer groups), w (served), u (binary: the short last group is in), z."""
    L = len(problem.layers)
    n, w, u, z = (np.arange(L) * 4 + k for k in range(4))
    c = np.zeros(4 * L)
    c[w], c[z] = [-problem.gain(i) / TIME_UNIT for i in range(L)], problem.speeds.sync_seconds / TIME_UNIT
    integrality = np.zeros(4 * L)
    integrality[n] = integrality[u] = integrality[z] = 1
    upper = np.full(4 * L, np.inf)
    rows, memory = _Rows(), []
    for i, g in enumerate(problem.layers):
        G, b = g.n_groups, problem.neuron_bytes[i]
        full = int(g.sizes[0]) if G else 0
        short = full * G - int(g.sizes.sum())  # neurons missing from the last group
        upper[n[i]], upper[u[i]], upper[z[i]] = G, float(short > 0), 1.0
        prefix = np.concatenate([[0.0], np.cumsum(g.values)])
        for k in range(G):  # tangents of the concave prefix sum: w <= P(n), tight at integer n
            rows.add([(w[i], 1.0), (n[i], -g.values[k])], -np.inf, prefix[k] - g.values[k] * k)
        rows.add([(n[i], 1.0), (z[i], -G)], -np.inf, 0.0)
        if short:
            rows.add([(u[i], G), (n[i], -1.0)], -np.inf, 0.0)  # u can be 1 only when n == G
        memory += [(n[i], full * b / BYTE_UNIT), (u[i], -short * b / BYTE_UNIT)]
    rows.add(memory, -np.inf, problem.budget / BYTE_UNIT)
    counts = lambda x: [int(round(x[n[i]])) for i in range(L)]  # noqa: E731
    return c, integrality, upper, rows, counts


def _groups(problem: Problem):
    """Columns: one binary per group (layers one after another), then z per layer."""
    L = len(problem.layers)
    first = np.cumsum([0] + [g.n_groups for g in problem.layers])
    n_x = int(first[-1])
    z = n_x + np.arange(L)
    c = np.zeros(n_x + L)
    c[z] = problem.speeds.sync_seconds / TIME_UNIT
    rows, memory = _Rows(), []
    for i, g in enumerate(problem.layers):
        b, x = problem.neuron_bytes[i], first[i] + np.arange(g.n_groups)
        c[x] = -problem.gain(i) / TIME_UNIT * g.values
        for k in range(g.n_groups - 1):
            rows.add([(x[k + 1], 1.0), (x[k], -1.0)], -np.inf, 0.0)
        if g.n_groups:
            rows.add([(x[0], 1.0), (z[i], -1.0)], -np.inf, 0.0)
        memory += [(x[k], g.sizes[k] * b / BYTE_UNIT) for k in range(g.n_groups)]
    rows.add(memory, -np.inf, problem.budget / BYTE_UNIT)
    counts = lambda sol: [int(round(sol[first[i] : first[i + 1]].sum())) for i in range(L)]  # noqa: E731
    return c, np.ones(n_x + L), np.ones(n_x + L), rows, counts


def solve_counts(problem: Problem, formulation: Formulation = "groups",
                 time_limit: float = DEFAULT_TIME_LIMIT) -> tuple[list[int], bool]:
    """Groups on the accelerator per layer within the budget, and whether proven optimal."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    build = {"cumulative": _cumulative, "groups": _groups}[formulation]
    c, integrality, upper, rows, counts = build(problem)
    matrix = csr_array((rows.data, (rows.rows, rows.columns)), shape=(len(rows.lo), len(c)))
    # Presolve only for "cumulative": without it HiGHS declared wrong plans optimal on a few tiny
    # instances (brute-force tests); "groups" never erred without it, and it costs seconds there.
    with _stdout_to_stderr():
        result = milp(c, integrality=integrality, bounds=Bounds(np.zeros(len(c)), upper),
                      constraints=LinearConstraint(matrix, rows.lo, rows.hi),
                      options={"time_limit": time_limit, "mip_rel_gap": 1e-6, "presolve": formulation == "cumulative"})
    if result.x is None:
        raise PowerInferError(f"placement solver failed: {result.message}")
    n = [min(max(k, 0), g.n_groups) for k, g in zip(counts(result.x), problem.layers)]
    return _within_budget(problem, n), result.status == 0


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """HiGHS occasionally prints a debug line on the C-level stdout, where generated text goes."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _within_budget(problem: Problem, n: list[int]) -> list[int]:
    """Guard against the solver's feasibility tolerance: drop the least valuable last groups until
    the exact byte count fits (a no-op: the tolerance is a fraction of a byte)."""
    while sum(problem.bytes_of(i, k) for i, k in enumerate(n)) > problem.budget:
        i = min((i for i in range(len(n)) if n[i] > 0), key=lambda i: problem.layers[i].values[n[i] - 1])
        n[i] -= 1
    return n


def plan_from_counts(counts: Sequence[torch.Tensor | np.ndarray], tokens: int, shape: ModelShape, budget: int,
                     speeds: Speeds = Speeds(), group_size: int = DEFAULT_GROUP_SIZE,
                     formulation: Formulation = "groups", time_limit: float = DEFAULT_TIME_LIMIT) -> Plan:
    """Solve the placement for per-layer activation counts over `tokens` calibration tokens."""
    if len(counts) != shape.n_layers:
        raise PowerInferError(f"activation statistics cover {len(counts)} layers, the model has {shape.n_layers}")
    for i, (c, n_ff) in enumerate(zip(counts, shape.n_ff)):
        if len(c) != n_ff:
            raise PowerInferError(f"activation statistics of layer {i} count {len(c)} neurons, the model has {n_ff}")
    if group_size < 1:
        raise PowerInferError("group size must be >= 1")
    started = time.perf_counter()
    groups = tuple(layer_groups(c, tokens, group_size) for c in counts)
    problem = Problem(groups, shape.neuron_bytes, max(int(budget), 0), speeds)
    n, optimal = solve_counts(problem, formulation, time_limit)
    hot = tuple(np.sort(g.order[: int(g.sizes[:k].sum())]).astype(np.int32) for g, k in zip(groups, n))
    total = sum(g.total for g in groups)
    served = sum(float(g.values[:k].sum()) for g, k in zip(groups, n))
    return Plan(hot, shape.n_ff, sum(problem.bytes_of(i, k) for i, k in enumerate(n)), max(int(budget), 0),
                served / total if total > 0 else 0.0, sum(problem.layer_time(i, k) for i, k in enumerate(n)),
                sum(problem.layer_time(i, 0) for i in range(len(n))), time.perf_counter() - started, optimal)
