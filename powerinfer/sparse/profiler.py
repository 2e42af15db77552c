"""Which FFN neurons fire, counted over calibration text (PowerInfer's activation statistics).

"Fired" means a non-zero output for ReLU-family activations; for SiLU/GELU-gated models, whose
activations are never exactly zero, |act(gate) * up| above a per-layer threshold calibrated on the
same text, for a target sparsity (the fraction of neurons skipped per token) or for a target error
(the largest sparsity whose mean relative error of the FFN output stays below it).

Output, PowerInfer's layout: DIR/activation/activation_{i}.pt, a 1-D int64 tensor of length n_ff
per layer (how often each neuron fired), plus DIR/activation/profile.json with the thresholds.
In a mixture of experts, i numbers FFN units (`ModelConfig.ffn_unit`: layer * n_expert + expert)
and an expert's counts are over the tokens routed to it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from powerinfer.errors import PowerInferError
from powerinfer.models.base import CausalLM
from powerinfer.outputs import OwnedNames, atomic_directory
from powerinfer.runtime.engine import Engine
from powerinfer.sparse.folders import load_json, load_torch_file, numbered_files
from powerinfer.sparse.select import kept, selected

MIN_CALIBRATION_TOKENS = 1024
HISTOGRAM_BINS = 4096
LOG2_RANGE = (-40.0, 24.0)  # |activation| from 1e-12 to 1.6e7
ERROR_SAMPLE_ROWS = 1024  # token rows per layer kept to measure output error
CANDIDATE_SPARSITIES = [i / 40 for i in range(1, 40)]
ACTIVATION_FILES = OwnedNames(re.compile(r"activation_\d+\.pt|profile\.json"), "activation_*.pt, profile.json")


@dataclass
class ActivationProfile:
    activation: str
    tokens: int
    thresholds: list[float]
    counts: list[torch.Tensor] = field(repr=False)
    target_sparsity: float | None = None
    target_error: float | None = None

    @property
    def sparsity(self) -> list[float]:
        """Per layer, the mean fraction of neurons that did not fire per token."""
        return [1.0 - float(c.sum()) / (self.tokens * len(c)) for c in self.counts]

    def save(self, directory: str | Path, replace: bool = True) -> None:
        """Write DIR/activation/ once everything is written (into a non-empty activation/ only
        when `replace`, and then touching only our files in it)."""
        with atomic_directory(Path(directory) / "activation", ACTIVATION_FILES, replace) as staging:
            for i, counts in enumerate(self.counts):
                torch.save(counts.to(torch.int64), staging / f"activation_{i}.pt")
            meta = {k: v for k, v in asdict(self).items() if k != "counts"}
            meta["sparsity"] = self.sparsity
            (staging / "profile.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: str | Path) -> ActivationProfile:
        """Read a profile directory (ours, or PowerInfer's activation/ without profile.json)."""
        directory = Path(directory)
        folder = directory / "activation" if (directory / "activation").is_dir() else directory
        counts = []
        for path in numbered_files(folder, "activation"):
            loaded = load_torch_file(path)
            if not isinstance(loaded, torch.Tensor) or loaded.is_complex() or not loaded.numel():
                raise PowerInferError(f"{path}: not a tensor of firing counts")
            counts.append(loaded.flatten())
        meta = load_json(folder / "profile.json")
        return cls(meta.get("activation", "relu"), int(meta.get("tokens", 0)) or int(max(c.max() for c in counts)),
                   list(meta.get("thresholds", [0.0] * len(counts))), counts,
                   meta.get("target_sparsity"), meta.get("target_error"))


def require_calibration_tokens(ids: Sequence[int], n_tokens: int | None) -> list[int]:
    """The first n_tokens ids (all when None), refused when too few to calibrate on."""
    ids = list(ids[:n_tokens] if n_tokens else ids)
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise PowerInferError(f"calibration text too short: {len(ids)} tokens, at least {MIN_CALIBRATION_TOKENS} needed")
    return ids


def calibration_chunks(ids: Sequence[int], n_tokens: int | None, chunk: int) -> list[list[int]]:
    ids = require_calibration_tokens(ids, n_tokens)
    return [ids[i : i + chunk] for i in range(0, len(ids) - chunk // 4, chunk)]  # drop a tiny tail


def observe_ffn(model: CausalLM, engine: Engine, chunks: list[list[int]], observer, desc: str) -> None:
    """Prefill each chunk from an empty cache with `observer(layer, residual, activations)` on every block."""
    for block in model.blocks:
        block.observer = observer
    try:
        for chunk in tqdm(chunks, desc=desc, unit="chunk"):
            engine.prefill(0, chunk, reuse_prefix=False)
    finally:
        for block in model.blocks:
            block.observer = None


def _thresholds_from_histograms(histograms: list[torch.Tensor], sparsity: float) -> list[float]:
    low, high = LOG2_RANGE
    edges = torch.linspace(low, high, HISTOGRAM_BINS + 1)
    thresholds = []
    for hist in histograms:
        cdf = torch.cumsum(hist, 0) / hist.sum()
        bin_index = int(torch.searchsorted(cdf, torch.tensor(sparsity)))
        thresholds.append(float(2 ** edges[min(bin_index + 1, HISTOGRAM_BINS)]))
    return thresholds


def calibrate_thresholds(model: CausalLM, engine: Engine, chunks: list[list[int]], target_sparsity: float | None,
                         target_error: float | None) -> tuple[list[float], float]:
    """Per-layer |activation| thresholds under which neurons count as not firing, for a target
    sparsity or (the largest sparsity within) a target error; returns them and the sparsity."""
    activation = model.config.activation
    if target_sparsity is None and target_error is None:
        raise PowerInferError(f"a {activation.value} model needs --target-sparsity or --target-error to define firing")
    n_units = model.config.n_ffn_units
    histograms = [torch.zeros(HISTOGRAM_BINS) for _ in range(n_units)]
    samples: list[list[torch.Tensor]] = [[] for _ in range(n_units)]
    generator = torch.Generator().manual_seed(0)

    def collect(unit: int, residual: torch.Tensor, a: torch.Tensor) -> None:
        a = a.float()  # int4 kernels give bfloat16: too coarse to count in
        log_magnitude = torch.log2(a.abs().clamp_min(2 ** LOG2_RANGE[0]))
        histograms[unit] += torch.histc(log_magnitude, HISTOGRAM_BINS, *LOG2_RANGE)
        kept = sum(len(s) for s in samples[unit])
        if target_error is not None and kept < ERROR_SAMPLE_ROWS:
            rows = torch.randperm(len(a), generator=generator)[: max(1, ERROR_SAMPLE_ROWS // len(chunks))]
            samples[unit].append(a[rows].clone())

    observe_ffn(model, engine, chunks, collect, "calibrating")
    if target_error is not None:
        target_sparsity = _sparsity_for_error(model, histograms, samples, target_error)
    return _thresholds_from_histograms(histograms, target_sparsity), target_sparsity


def firing_thresholds(model: CausalLM, chunks: list[list[int]], target_sparsity: float | None = None,
                      target_error: float | None = None) -> tuple[list[float], float | None]:
    """Per FFN unit: 0 for ReLU-family models (any non-zero output fires), else calibrated on `chunks`."""
    if model.config.activation.is_relu_family:
        return [0.0] * model.config.n_ffn_units, None
    return calibrate_thresholds(model, Engine(model, max(len(c) for c in chunks)), chunks, target_sparsity, target_error)


def profile_activations(model: CausalLM, ids: Sequence[int], n_tokens: int | None = None, chunk: int = 512,
                        target_sparsity: float | None = None, target_error: float | None = None) -> ActivationProfile:
    """Count neuron firings over `ids` (calibrating thresholds first for non-ReLU models)."""
    chunks = calibration_chunks(ids, n_tokens, chunk)
    thresholds, target_sparsity = firing_thresholds(model, chunks, target_sparsity, target_error)
    counts = [torch.zeros(unit.ffn.n_ff, dtype=torch.int64) for unit in model.ffn_units()]

    def count(unit: int, residual: torch.Tensor, a: torch.Tensor) -> None:
        counts[unit] += kept(a.float(), thresholds[unit]).sum(0)

    observe_ffn(model, Engine(model, chunk), chunks, count, "profiling")
    return ActivationProfile(model.config.activation.value, sum(len(c) for c in chunks), thresholds, counts,
                             target_sparsity, target_error)


def _sparsity_for_error(model: CausalLM, histograms, samples, target_error: float) -> float:
    """The largest candidate sparsity whose FFN outputs, on sampled tokens of every layer, keep a
    mean relative error within `target_error`."""
    best = 0.0
    units = [(unit.ffn, torch.cat(s)) for unit, s in zip(model.ffn_units(), samples)]
    with torch.inference_mode():
        exact = [ffn.project(a) if len(a) else None for ffn, a in units]
        for sparsity in CANDIDATE_SPARSITIES:
            thresholds = _thresholds_from_histograms(histograms, sparsity)
            errors = []
            for (ffn, a), y, t in zip(units, exact, thresholds):
                if y is None:  # an expert no sampled token was routed to
                    continue
                approx = ffn.project(selected(a, t))
                errors.append(float(((approx - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12)).mean()))
            if max(errors) > target_error:
                break
            best = sparsity
    return best
