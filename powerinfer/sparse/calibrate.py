"""Calibration: what the inputs of every site look like on calibration text.

One pass over the text (chunks evaluated from an empty cache, as perplexity evaluates them) gathers,
per site (the head's too), a histogram of the selection score over tokens and channels, for both criteria:
- "teal": |x_i| (TEAL: one threshold per site, the same for every channel);
- "wina": |x_i| * ||W[:, i]|| (WINA: the channel's contribution bound; threshold_i = t / ||W[:, i]||).
A site's threshold for a sparsity s is the s-quantile of its score, so a vector per site either way.
It also keeps the block inputs of the first chunks, on which the allocation measures block errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from tqdm import tqdm

from powerinfer.errors import PowerInferError
from powerinfer.models.base import CausalLM
from powerinfer.runtime.kv_cache import KVCache, SeqSpan
from powerinfer.sparse.profiler import require_calibration_tokens
from powerinfer.sparse.sites import Site, model_sites, tapped
from powerinfer.sparse.storage import HEAD

Criterion = Literal["teal", "wina"]
CRITERIA: tuple[Criterion, ...] = ("teal", "wina")
DEFAULT_CHUNK = 512
DEFAULT_TOKENS = 8192  # 16 chunks: thresholds settle well before this (quantiles over millions of values)
OBSERVED_ROW_STRIDE = 4
DEFAULT_PROBE_CHUNKS = 1  # chunks whose block inputs the allocation measures errors on


class ScoreHistogram:
    """Counts of non-negative float32 scores by their exponent and top MANTISSA_BITS mantissa bits:
    log-spaced bins (at most 1.6 % wide) over every float, counted with one bincount of the bit
    patterns (no log per value: calibration sees tens of millions of values per chunk). Its
    quantiles are interpolated inside a bin."""

    MANTISSA_BITS = 6
    SHIFT = 23 - MANTISSA_BITS
    BINS = 1 << (31 - SHIFT)  # every pattern with the sign bit clear

    def __init__(self) -> None:
        self.counts = torch.zeros(self.BINS, dtype=torch.int64)

    def add(self, scores: torch.Tensor) -> None:
        bins = scores.float().abs().contiguous().view(torch.int32) >> self.SHIFT
        self.counts += torch.bincount(bins.flatten(), minlength=self.BINS)

    def quantile(self, sparsity: float) -> float:
        """The score at or under which a `sparsity` fraction of the values fell (0: nothing skipped),
        interpolated linearly inside its bin."""
        if sparsity <= 0:
            return 0.0
        total = int(self.counts.sum())
        cdf = torch.cumsum(self.counts, 0).double() / total
        index = min(int(torch.searchsorted(cdf, torch.tensor(min(sparsity, 1.0), dtype=torch.float64))), self.BINS - 1)
        low, high = (float(torch.tensor(b << self.SHIFT, dtype=torch.int32).view(torch.float32)) for b in (index, index + 1))
        below = float(cdf[index - 1]) if index else 0.0
        share = (sparsity - below) * total / max(int(self.counts[index]), 1)
        return low + (high - low) * min(max(share, 0.0), 1.0)


@dataclass(eq=False)
class SiteStatistics:
    """One site's calibration: its weights' column norms and the histograms of both criteria."""

    site: Site
    column_norms: torch.Tensor
    histograms: dict[Criterion, ScoreHistogram] = field(default_factory=lambda: {c: ScoreHistogram() for c in CRITERIA})

    def observe(self, x: torch.Tensor) -> torch.Tensor:
        # every OBSERVED_ROW_STRIDE-th token: ample for quantiles, and counting every value would cost
        # about as much as the forward pass itself
        magnitude = x.detach().reshape(-1, x.shape[-1])[::OBSERVED_ROW_STRIDE].float().abs().cpu()
        self.histograms["teal"].add(magnitude)
        self.histograms["wina"].add(magnitude * self.column_norms)
        return x

    def thresholds(self, sparsity: float, criterion: Criterion) -> torch.Tensor:
        """Per-channel thresholds (float32 [in]) that skip a `sparsity` fraction of this site's inputs."""
        t = self.histograms[criterion].quantile(sparsity)
        if criterion == "teal":
            return torch.full_like(self.column_norms, t)
        # a zero column contributes nothing: always skipped
        return torch.where(self.column_norms > 0, t / self.column_norms, torch.finfo(torch.float32).max)


@dataclass(eq=False)
class Calibration:
    """What the allocation needs: the model, its sites and their statistics, the calibration chunks,
    and the dense inputs of every block on the first chunks (`probe_inputs[layer][chunk]`)."""

    model: CausalLM
    sites: list[Site]
    statistics: dict[str, SiteStatistics]
    chunks: list[list[int]]
    probe_inputs: list[list[torch.Tensor]]


def calibration_chunks(ids: Sequence[int], bos_id: int | None, n_tokens: int | None = DEFAULT_TOKENS,
                       chunk: int = DEFAULT_CHUNK) -> list[list[int]]:
    """The tokenized calibration text cut into chunks of `chunk` tokens (a short tail dropped), each
    starting with BOS where the model uses one, as perplexity evaluates them; refused when too short."""
    ids = require_calibration_tokens(ids, n_tokens)
    chunks = [list(ids[i : i + chunk]) for i in range(0, len(ids) - chunk // 4, chunk)]
    if bos_id is not None:
        for c in chunks:
            c[0] = bos_id
    return chunks


# Identity rows per probe of `column_norms`: a 262k-entry head's outputs for 64 of them are 64 MiB.
NORM_PROBE_ROWS = 64


def column_norms(site: Site) -> torch.Tensor:
    """||W[:, i]|| of the site's linear as the model computes it: probed with the identity (exact in
    any activation dtype), bias removed, so every weight layout and device is handled alike."""
    linear = site.linear
    n = linear.in_features
    with torch.inference_mode():
        bias = linear(torch.zeros(1, n)).float()
        norms = [torch.linalg.vector_norm((linear(torch.eye(n)[i : i + NORM_PROBE_ROWS]).float() - bias).cpu(), dim=1)
                 for i in range(0, n, NORM_PROBE_ROWS)]
    return torch.cat(norms).float()


def new_cache(model: CausalLM, n_ctx: int) -> KVCache:
    """A one-slot cache of the type the engine would give `model`."""
    return model.new_cache(n_ctx, 1, "f32" if model.float32 else "f16")


def block_inputs(model: CausalLM, chunk: Sequence[int], cache: KVCache) -> list[torch.Tensor]:
    """Evaluate `chunk` from an empty cache; the input of every block (the residual stream), then the
    head's input (the final norm's output)."""
    spans = [SeqSpan(0, 0, len(chunk))]
    x = model.embed(torch.tensor(list(chunk)), spans)
    inputs = []
    for block in model.blocks:
        inputs.append(x.clone())
        x = block(x, spans, cache)
    return [*inputs, model.logits(x, spans, "hidden")]


def calibrate(model: CausalLM, chunks: list[list[int]], probe_chunks: int = DEFAULT_PROBE_CHUNKS,
              progress: bool = True) -> Calibration:
    """Run `chunks` through `model`, gathering every site's statistics (see the module's note)."""
    if not chunks:
        raise PowerInferError("no calibration text: nothing to calibrate on")
    sites = model_sites(model)
    statistics = {s.name: SiteStatistics(s, column_norms(s)) for s in sites}
    cache = new_cache(model, max(len(c) for c in chunks))
    probes: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    taps = {name: stats.observe for name, stats in statistics.items() if name != HEAD}
    with torch.inference_mode(), tapped(sites, taps):
        for index, chunk in enumerate(tqdm(chunks, desc="calibrating", unit="chunk", disable=not progress)):
            *inputs, hidden = block_inputs(model, chunk, cache)
            statistics[HEAD].observe(hidden)  # the head itself need not run: its input is all we count
            if index < probe_chunks:
                for layer, x in enumerate(inputs):
                    probes[layer].append(x)
    return Calibration(model, sites, statistics, chunks, probes)
