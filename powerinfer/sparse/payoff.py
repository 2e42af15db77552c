"""Whether skipping a site's input channels pays on this machine: measured, not assumed.

Channel runs (columns.py) read only the selected channels' bytes, but skipping a short run saves
little memory traffic (the hardware prefetchers fetch its neighbours), and a block's scales are read
whatever it skips: the share of channels a site must skip before it decodes faster than by rows
depends on the CPU, the threads and the linear's shape. `BreakEven` times both layouts once per distinct shape
(random blocks: the speed does not depend on the values; copies rotating, so that every call reads
from memory as decoding does) and finds the least sparsity at which the columns win by a margin.
`decode_speedup` then measures what counts: the sparsified model's decode against its source's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops.linear import Linear, build_linear
from powerinfer.ops.quant import T, random_blocks, row_bytes
from powerinfer.sparse.columns import ColumnLinear, RowMatrix

if TYPE_CHECKING:
    from powerinfer.llm import LLM

# The sparsities tried, in order: a site pays from the first one at which its columns win.
SPARSITY_STEPS = tuple(round(0.1 * i, 1) for i in range(1, 10))
NEVER = 1.0  # the break-even of a shape whose columns never win
FROM_MEMORY_BYTES = 96 << 20  # copies of a linear rotate until they hold this much (3x a 32 MiB L3)
# ... or the model's weights, where they are fewer: a decode step reads every linear once, so a linear
# is in cache at its next use only where the whole model fits. (A cap of 32 copies had SmolLM2's
# 0.35 MB q/k/v inputs timed from L3 at 11 MB, where runs beat rows 1.6x; in its 96 MB decode step
# they read from memory and lose.)
MAX_COPIES = 1024
MIN_SECONDS = 0.05  # per measurement
MIN_CALLS = 9
# The columns must beat the rows by this factor for a site to take part and to keep its thresholds (a
# win within a timing's noise is no win). What a decode step adds beside a site's call (its selection,
# one more parallel region, the other thread's wait, the memory's other tenants) is measured after, on
# the whole file: it must decode DECODE_MARGIN times as fast as its source, or it is written dense.
# (With a margin of 1.05 and no such check, Gemma 3 270M's default file, its head's runs 1.02-1.05x its
# rows alone at a third skipped, decoded at 0.91-0.99x its source on an AMD EPYC; with 1.2, that head's
# break-even on an Intel Xeon, 0.30-0.34, was about the share its budget gives it, 0.33, at which the
# file decodes 1.05-1.15x its source there.)
PAYOFF_MARGIN = 1.1
ROUNDS = 3  # timings of rows and columns, taking turns, per sparsity step: the median ratio counts
DECODE_MARGIN = 1.03
DECODE_ROUNDS = 8  # the two models taking turns (ABBA); the median ratio counts
DECODE_TOKENS = 32  # per model and round


@dataclass(frozen=True)
class LinearShape:
    """A (fused) linear as its file stores it by rows."""

    in_features: int
    rows: tuple[tuple[T, int], ...]  # per matrix: its row type, its outputs

    @property
    def row_bytes(self) -> int:
        return sum(out * row_bytes(t, self.in_features) for t, out in self.rows)


def median_seconds(layers: Sequence[Callable[[torch.Tensor], object]], x: torch.Tensor, min_seconds: float = MIN_SECONDS,
                   clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of a call, the copies of a layer taking turns (so that each reads from memory)."""
    times, started = [], time.perf_counter()
    while time.perf_counter() - started < min_seconds or len(times) < max(MIN_CALLS, 3 * len(layers)):
        layer = layers[len(times) % len(layers)]
        t = clock()
        layer(x)
        times.append(clock() - t)
    return statistics.median(times)


def _copies(shape: LinearShape, working_set: int) -> int:
    return min(MAX_COPIES, max(2, -(-min(working_set, FROM_MEMORY_BYTES) // shape.row_bytes)))


def _row_layers(shape: LinearShape, rng: np.random.Generator, working_set: int) -> list[Linear]:
    tensors = lambda: [GGUFTensor(f"w{i}", t, (out, shape.in_features), random_blocks(t, out, shape.in_features, rng))  # noqa: E731
                       for i, (t, out) in enumerate(shape.rows)]
    return [build_linear(tensors()) for _ in range(_copies(shape, working_set))]


def random_column_linear(in_features: int, rows: Sequence[tuple[T, int]], rng: np.random.Generator) -> ColumnLinear:
    """A ColumnLinear of random blocks, per matrix its row type and outputs, thresholds 0."""
    matrices = [RowMatrix(torch.from_numpy(random_blocks(t, out, in_features, rng)), t, in_features) for t, out in rows]
    return ColumnLinear(matrices, torch.zeros(in_features))


def _column_layers(shape: LinearShape, rng: np.random.Generator, working_set: int) -> list[ColumnLinear]:
    return [random_column_linear(shape.in_features, shape.rows, rng) for _ in range(_copies(shape, working_set))]


def break_even_of(speedup: Callable[[float], float]) -> float:
    """The sparsity at which the speed-up (rows' time / columns' time, as `speedup` measures it at
    SPARSITY_STEPS, in order until one reaches PAYOFF_MARGIN) reaches the margin, interpolated between
    that step and the one before (the steps are 10 % apart: a site allocated 28 % must not wait for
    30 %), or NEVER."""
    before = None
    for sparsity in SPARSITY_STEPS:
        gain = speedup(sparsity)
        if gain >= PAYOFF_MARGIN:
            if before is None:
                return sparsity
            return before[0] + (sparsity - before[0]) * (PAYOFF_MARGIN - before[1]) / (gain - before[1])
        before = (sparsity, gain)
    return NEVER


def measured_break_even(shape: LinearShape, working_set: int = FROM_MEMORY_BYTES) -> float:
    """The sparsity from which one row through channel runs beats the rows by PAYOFF_MARGIN (NEVER
    if none of SPARSITY_STEPS does), timed on this machine with torch's threads, copies of the
    linear rotating through `working_set` bytes (the model's weights)."""
    rng = np.random.default_rng(0)
    x = torch.randn(1, shape.in_features, generator=torch.Generator().manual_seed(0))
    rows, columns = _row_layers(shape, rng, working_set), _column_layers(shape, rng, working_set)

    def speedup(sparsity: float) -> float:
        level = float(torch.quantile(x.abs(), sparsity))
        for layer in columns:
            layer.thresholds.fill_(level)
        return statistics.median(median_seconds(rows, x) / median_seconds(columns, x) for _ in range(ROUNDS))

    return break_even_of(speedup)


@dataclass
class BreakEven:
    """Break-even sparsities by shape, each measured once (`measure`: how, given the bytes of the
    model's weights, `working_set`)."""

    measure: Callable[[LinearShape, int], float] = measured_break_even
    working_set: int = FROM_MEMORY_BYTES
    known: dict[LinearShape, float] = field(default_factory=dict)

    def __call__(self, shape: LinearShape) -> float:
        if shape not in self.known:
            self.known[shape] = self.measure(shape, self.working_set)
        return self.known[shape]

    def pays(self, shape: LinearShape, sparsity: float) -> bool:
        """Whether a site of this shape skipping `sparsity` of its channels decodes faster so."""
        return sparsity > 0 and sparsity >= self(shape)


def decode_rate(llm: LLM, prompt: list[int], n_gen: int) -> float:
    """Greedy single-token decode steps after `prompt` (tok/s), on `llm`'s engine from an empty slot."""
    engine = llm.engine
    engine.release(0)
    engine.extend(0, prompt)
    token = prompt[-1]
    started = time.perf_counter()
    for _ in range(n_gen):
        token = int(engine.extend(0, [token])[-1].argmax())
    return n_gen / (time.perf_counter() - started)


def decode_speedup(sparse: LLM, dense: LLM, prompt: list[int], rounds: int = DECODE_ROUNDS,
                   n_gen: int = DECODE_TOKENS, progress: bool = True) -> float:
    """The median over `rounds` of `sparse`'s decode rate over `dense`'s, the two taking turns (ABBA:
    each round's pair meets the same spell of the shared memory, and neither always runs first)."""
    for llm in (sparse, dense):
        decode_rate(llm, prompt, 2)  # warm: the first steps build the native step and fault pages in
    ratios: list[float] = []
    with tqdm(total=rounds, desc="measuring the decode speed-up", unit="round", disable=not progress) as bar:
        for r in range(rounds):
            if r % 2 == 0:
                sparse_rate, dense_rate = decode_rate(sparse, prompt, n_gen), decode_rate(dense, prompt, n_gen)
            else:
                dense_rate, sparse_rate = decode_rate(dense, prompt, n_gen), decode_rate(sparse, prompt, n_gen)
            ratios.append(sparse_rate / dense_rate)
            bar.set_postfix_str(f"{statistics.median(ratios):.2f}x the source")
            bar.update()
    return statistics.median(ratios)
