"""Allocation: a model-level target sparsity spread across layers and sites.

Model-level sparsity is the fraction of the sites' weights (the block linears' and the head's) not
read per token: each site's sparsity weighted by its linear's weight count.

Only the sites taking part (`Allocator(taking_part=...)`: sparsify names those whose skipping pays
on this machine) get a share; the others stay dense. The head is outside every block: it is put at
the target in every method (no block error measures it).

Methods (METHODS):
- "uniform": every site at the target (TEAL's baseline);
- "blockwise": TEAL's block-wise greedy. Per block, starting dense, repeatedly raise by one `step`
  the sparsity of the site whose step costs the least increase of the block's output error per
  weight saved (measured on the dense block inputs of calibration chunks), giving a curve of
  allocations; every block is then put at the target on its curve;
- "global": the same curves, merged across blocks by the same rule: the next step taken anywhere
  in the model is the one that costs the least error per weight saved, until the target. The
  error is each block's relative output error, so steps of different blocks compare;
- "measured" (the default): whichever of "blockwise" and "uniform" gives the first MEASURE_CHUNKS
  calibration chunks the lower perplexity (within a perplexity bound: the larger sparsity). The
  greedy's block-local error misjudges a model whose later layers rescale a block's output (Gemma
  3's post-norms); the whole model's perplexity does not, but 4 chunks are a noisy referee where the
  two are close. Measured (wikitext-2 test, 20 chunks, `--all-sites`, targets 10-70 %;
  benchmarks/results/sparsity_quality_head.md): on SmolLM2 it chose uniform at 10 % and blockwise
  above, on Gemma 3 270M blockwise at 30 % and 70 % and uniform elsewhere: on test, the better of the
  two at 11 of the 14 points, and never worse than blockwise. (The last 4 calibration chunks instead,
  held out from the greedy's probe, chose worse on Gemma: the better method at 1 of 7 targets.)
All are deterministic: the same calibration gives the same thresholds.

Measured on SmolLM2-135M Q4_1 (wikitext-2 test, 6 chunks of 512, WINA criterion;
benchmarks/results/sparsity_quality.md): at 30 % model-wide, blockwise 1.023x dense perplexity,
uniform 1.041x, global 1.199x; at 40 %: 1.138x, 1.140x, 2.10x ("blockwise" was the default before "measured"). The
global merge loses: a relative block error is not comparable across blocks (SmolLM2's residual
stream has large outlier channels in some layers, which make their relative errors look small).
(Those figures are of the error summed over tokens; BlockProbe now averages each token's relative
error, which took Gemma 3 270M's blockwise 30 % from 1.29x to 1.065x test perplexity (uniform 1.044x):
benchmarks/results/sparsity_quality_head.md.)
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

from powerinfer.errors import PowerInferError
from powerinfer.runtime.kv_cache import SeqSpan
from powerinfer.sparse.calibrate import CRITERIA, Calibration, Criterion, new_cache
from powerinfer.sparse.sites import SITE_KINDS, Site, masked, site_name
from powerinfer.tools.perplexity import perplexity

Method = Literal["measured", "uniform", "blockwise", "global"]
METHODS: tuple[Method, ...] = ("measured", "uniform", "blockwise", "global")
MEASURED_AMONG: tuple[Method, ...] = ("blockwise", "uniform")  # what "measured" chooses from; ties: the first
MEASURE_CHUNKS = 4  # calibration chunks whose perplexity "measured" and `within_perplexity` compare (by default)
GREEDY_STEP = 0.1  # site sparsity per greedy step
MAX_SITE_SPARSITY = 0.9
PPL_SEARCH_STEPS = 7  # bisection steps of `within_perplexity`: the target to within 0.9 / 2**7 (0.7 %)


@dataclass(frozen=True, eq=False)
class SiteAllocation:
    """One site's share: the fraction of its input channels expected to be skipped per token (on
    the calibration text) and the per-channel thresholds (float32 [in]) that skip them."""

    sparsity: float
    thresholds: torch.Tensor


@dataclass(eq=False)
class Allocation:
    """Per site name, its SiteAllocation; `weights` per site name, its linear's weight count;
    `target`: the model-level sparsity asked for."""

    target: float
    criterion: Criterion
    method: Method
    sites: dict[str, SiteAllocation]
    weights: dict[str, int]

    @property
    def sparsity(self) -> float:
        """Expected model-level sparsity: the fraction of the sites' weights not read."""
        return self.sparsity_at(self.sites)

    def sparsity_at(self, names: Collection[str]) -> float:
        """The fraction of the sites' weights not read when only the sites `names` skip."""
        return sum(a.sparsity * self.weights[n] for n, a in self.sites.items() if n in names) / sum(self.weights.values())

    @property
    def thresholds(self) -> dict[str, torch.Tensor]:
        return {name: a.thresholds for name, a in self.sites.items()}


def allocation_for(calibration: Calibration, target: float, sparsities: dict[str, float], criterion: Criterion,
                   method: Method) -> Allocation:
    """The allocation giving each named site its sparsity (every site must be named)."""
    stats = calibration.statistics
    return Allocation(target, criterion, method,
                      {n: SiteAllocation(s, stats[n].thresholds(s, criterion)) for n, s in sparsities.items()},
                      {n: stats[n].site.weight_count for n in sparsities})


@dataclass(eq=False)
class BlockCurve:
    """The greedy's path through one block: `points[j]` the site sparsities (by kind) after j steps,
    `errors[j]` the block's relative output error there."""

    layer: int
    weights: dict[str, int]
    points: list[dict[str, float]]
    errors: list[float]

    def saved(self, j: int) -> float:
        """Weights not read at point j."""
        return sum(self.points[j][k] * w for k, w in self.weights.items())

    def at(self, position: float) -> dict[str, float]:
        """Site sparsities at a fractional point (linear between the greedy's points), by site name."""
        j = min(int(position), len(self.points) - 1)
        f = position - j if j + 1 < len(self.points) else 0.0
        return {site_name(self.layer, k): (1 - f) * self.points[j][k] + f * self.points[min(j + 1, len(self.points) - 1)][k]
                for k in self.weights}

    def position_of(self, saved: float) -> float:
        """The fractional point where `saved` weights are not read (the last point when beyond it)."""
        for j in range(len(self.points) - 1):
            low, high = self.saved(j), self.saved(j + 1)
            if saved <= high:
                return j + (saved - low) / (high - low) if high > low else float(j)
        return float(len(self.points) - 1)


class BlockProbe:
    """One block evaluated on its dense calibration inputs: the relative error of its output with
    some of its sites (`sites`, of this block) masked, per token, averaged over the tokens. Per token:
    a few tokens' residual streams are far larger than the rest (attention sinks: on Gemma 3 270M the
    first token holds a fifth of some blocks' squared output), and an error summed over tokens
    measured mostly theirs."""

    def __init__(self, calibration: Calibration, layer: int, sites: list[Site], cache):
        self.block, self.cache, self.sites = calibration.model.blocks[layer], cache, sites
        self.inputs = calibration.probe_inputs[layer]
        self.dense = [self._run(x) for x in self.inputs]
        self.norms = [d.double().square().sum(dim=1).clamp_min(1e-30) for d in self.dense]
        self.tokens = sum(len(d) for d in self.dense)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, [SeqSpan(0, 0, len(x))], self.cache).float()

    def error(self, thresholds: dict[str, torch.Tensor]) -> float:
        with masked(self.sites, thresholds):
            outputs = [self._run(x) for x in self.inputs]
        return sum(float(((o - d).double().square().sum(dim=1) / n).sum())
                   for o, d, n in zip(outputs, self.dense, self.norms)) / self.tokens


def block_curve(calibration: Calibration, layer: int, sites: list[Site], criterion: Criterion, cache,
                step: float = GREEDY_STEP, max_sparsity: float = MAX_SITE_SPARSITY) -> BlockCurve:
    """TEAL's block-wise greedy over `sites` of block `layer` (see the module's note), up to
    `max_sparsity` at every site."""
    if not sites:
        return BlockCurve(layer, {}, [{}], [0.0])
    probe = BlockProbe(calibration, layer, sites, cache)
    stats = calibration.statistics
    weights = {s.kind: s.weight_count for s in probe.sites}
    steps = round(max_sparsity / step)
    threshold_cache: dict[tuple[str, int], torch.Tensor] = {}

    def thresholds(levels: dict[str, int]) -> dict[str, torch.Tensor]:
        for kind, level in levels.items():
            if (kind, level) not in threshold_cache:
                threshold_cache[kind, level] = stats[site_name(layer, kind)].thresholds(level * step, criterion)
        return {site_name(layer, k): threshold_cache[k, level] for k, level in levels.items()}

    levels = dict.fromkeys(weights, 0)
    points, errors = [{k: 0.0 for k in weights}], [0.0]

    def step_cost(kind: str) -> tuple[float, float, int]:
        """(error increase per weight saved, error, the point measured at) of one more step at `kind`."""
        error = probe.error(thresholds({**levels, kind: levels[kind] + 1}))
        return (error - errors[-1]) / weights[kind], error, len(points)

    # Lazy greedy: a step's cost measured at an earlier point stands in for its cost now until it
    # is the cheapest, and is then measured again (masking one site changes the cost of another's
    # step little): about one block evaluation per step instead of one per site.
    costs = {kind: step_cost(kind) for kind in SITE_KINDS if kind in levels}
    while costs:
        kind = min(costs, key=lambda k: (costs[k][0], SITE_KINDS.index(k)))  # ties: SITE_KINDS order
        if costs[kind][2] < len(points):
            costs[kind] = step_cost(kind)
            continue
        levels[kind] += 1
        points.append({k: level * step for k, level in levels.items()})
        errors.append(costs.pop(kind)[1])
        if levels[kind] < steps:
            costs[kind] = step_cost(kind)
    return BlockCurve(layer, weights, points, errors)


def block_curves(calibration: Calibration, criterion: Criterion, sites: list[Site], step: float = GREEDY_STEP,
                 progress: bool = True) -> list[BlockCurve]:
    """Every block's greedy curve over its sites among `sites`."""
    cache = new_cache(calibration.model, max(len(x) for inputs in calibration.probe_inputs for x in inputs))
    with torch.inference_mode():
        return [block_curve(calibration, layer, [s for s in sites if s.layer == layer], criterion, cache, step)
                for layer in tqdm(range(len(calibration.probe_inputs)), desc="allocating", unit="block",
                                  disable=not progress)]


def blockwise_sparsities(curves: list[BlockCurve], target: float) -> dict[str, float]:
    """TEAL: every block at the target on its own curve."""
    sparsities = {}
    for curve in curves:
        sparsities.update(curve.at(curve.position_of(target * sum(curve.weights.values()))))
    return sparsities


def global_sparsities(curves: list[BlockCurve], target: float) -> dict[str, float]:
    """The steps of all curves taken cheapest first (error per weight saved) until the target."""
    needed = target * sum(sum(c.weights.values()) for c in curves)
    positions = [0.0] * len(curves)
    saved = 0.0
    while saved < needed:
        open_curves = [i for i, c in enumerate(curves) if positions[i] < len(c.points) - 1]
        if not open_curves:
            break

        def cost(i: int) -> float:
            c, j = curves[i], int(positions[i])
            return (c.errors[j + 1] - c.errors[j]) / max(c.saved(j + 1) - c.saved(j), 1e-30)

        i = min(open_curves, key=cost)  # ties: the lowest layer
        c, j = curves[i], int(positions[i])
        gain = c.saved(j + 1) - c.saved(j)
        if saved + gain > needed:  # the last step is taken in part, to land on the target
            positions[i] = j + (needed - saved) / gain
            saved = needed
        else:
            positions[i], saved = j + 1.0, saved + gain
    sparsities = {}
    for curve, position in zip(curves, positions):
        sparsities.update(curve.at(position))
    return sparsities


class Allocator:
    """Allocations of one calibration under one criterion, for any target and method: the greedy
    curves are measured once, on first use, and reused."""

    def __init__(self, calibration: Calibration, criterion: Criterion = "wina", progress: bool = True,
                 taking_part: Collection[str] | None = None, measure_chunks: int = MEASURE_CHUNKS):
        if criterion not in CRITERIA:
            raise PowerInferError(f"unknown selection criterion {criterion!r} (expected one of {', '.join(CRITERIA)})")
        self.calibration, self.criterion, self.progress = calibration, criterion, progress
        self.sites = [s for s in calibration.sites if taking_part is None or s.name in taking_part]
        self._curves: list[BlockCurve] | None = None
        self.measure_chunks = measure_chunks
        # by the sites' sparsities (methods that agree share one measurement); None: dense
        self._perplexities: dict[tuple[tuple[str, float], ...] | None, float] = {}

    def among(self, taking_part: Collection[str]) -> Allocator:
        """An allocator of the same calibration and criterion whose taking part are `taking_part`
        (perplexities measured so far are kept: they depend on the sparsities alone)."""
        narrowed = Allocator(self.calibration, self.criterion, self.progress, taking_part, self.measure_chunks)
        narrowed._perplexities = self._perplexities
        return narrowed

    @property
    def curves(self) -> list[BlockCurve]:
        if self._curves is None:
            self._curves = block_curves(self.calibration, self.criterion, self.sites, progress=self.progress)
        return self._curves

    def allocate(self, target: float, method: Method = "measured") -> Allocation:
        """The allocation for a model-level `target` sparsity in [0, 1)."""
        if method not in METHODS:
            raise PowerInferError(f"unknown allocation method {method!r} (expected one of {', '.join(METHODS)})")
        if not (isinstance(target, (int, float)) and math.isfinite(target) and 0 <= target < 1):
            raise PowerInferError(f"target sparsity {target!r} out of range: expected a fraction in [0, 1)")
        if method == "measured":
            candidates = [self.allocate(target, m) for m in MEASURED_AMONG]
            return min(candidates, key=lambda a: self.perplexity(a))  # min keeps the first of equals
        sparsities = {s.name: 0.0 for s in self.calibration.sites}
        # the sites outside the blocks (the head), and with "uniform" every site, at the target
        sparsities.update({s.name: float(target) for s in self.sites if method == "uniform" or s.layer is None})
        if method == "blockwise":
            sparsities.update(blockwise_sparsities(self.curves, target))
        elif method == "global":
            sparsities.update(global_sparsities(self.curves, target))
        return allocation_for(self.calibration, target, sparsities, self.criterion, method)

    def perplexity(self, allocation: Allocation | None) -> float:
        """Perplexity of the first `measure_chunks` calibration chunks masked by `allocation` (None: dense)."""
        key = None if allocation is None else tuple((n, a.sparsity) for n, a in allocation.sites.items())
        if key not in self._perplexities:
            self._perplexities[key] = calibration_perplexity(self.calibration, allocation,
                                                             self.calibration.chunks[:self.measure_chunks])
        return self._perplexities[key]

    def within_perplexity(self, max_increase: float, method: Method = "measured", highest: float = 0.9) -> Allocation:
        """The allocation for the largest target (to 0.7 %, bisected) whose perplexity on the first
        `measure_chunks` calibration chunks stays within `max_increase` times the dense model's."""
        if not (isinstance(max_increase, (int, float)) and math.isfinite(max_increase) and max_increase >= 1):
            raise PowerInferError(f"perplexity increase {max_increase!r} out of range: expected a factor >= 1 (e.g. 1.03)")
        if method == "measured":
            # the largest sparsity; of equals, the lower perplexity (max keeps the first of equals)
            candidates = [self.within_perplexity(max_increase, m, highest) for m in MEASURED_AMONG]
            return max(candidates, key=lambda a: (a.sparsity, -self.perplexity(a)))
        bound = self.perplexity(None) * max_increase
        low, high = 0.0, highest
        for _ in tqdm(range(PPL_SEARCH_STEPS), desc=f"searching the target within {max_increase}x perplexity ({method})",
                      unit="step", disable=not self.progress):
            middle = (low + high) / 2
            if self.perplexity(self.allocate(middle, method)) <= bound:
                low = middle
            else:
                high = middle
        return self.allocate(low, method)


def calibration_perplexity(calibration: Calibration, allocation: Allocation | None, chunks: list[list[int]]) -> float:
    """Perplexity of `chunks` (llama.cpp's method: each chunk's second half scored), masked by `allocation`."""
    model = calibration.model
    cache = new_cache(model, max(len(c) for c in chunks))

    def logits_of(ids: list[int]) -> torch.Tensor:
        return model.forward(torch.tensor(ids), [SeqSpan(0, 0, len(ids))], cache, "all")

    with torch.inference_mode(), masked(calibration.sites, allocation.thresholds if allocation else {}):
        *_, result = perplexity(logits_of, chunks)
    return result.ppl

