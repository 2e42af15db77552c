"""Activation predictors: training, evaluation and PowerInfer's predictor directory.

A predictor (PowerInfer's shape: Linear d->R, ReLU, Linear R->n_ff, no biases) maps a layer's FFN
input (the residual stream after attention, before the FFN norm) to a score per neuron; the neuron
is computed when its score is >= the layer's threshold. PowerInfer never released its training;
ours learns from the model's own activations over calibration text:

- tokens are split into train / calibration / held-out parts (by chunk, in that order);
- per layer and candidate rank R a predictor is fitted with binary
  cross-entropy; inputs are scaled per dimension while training and the scale is folded into fc1;
- the score threshold is the one that reaches the recall target (with a margin) on the calibration part; ranks
  are tried from the smallest up, and the search stops at the first R whose next candidate gains less than
  `rank_tolerance` of predicted sparsity (large ranks cost the most to fit, so they are fitted only when they pay);
- recall, precision and sparsity are reported on the held-out part, which nothing was fitted to.

Predictors are trained per FFN unit (`ModelConfig.ffn_unit`): one per layer, or one per expert of a
mixture of experts, learnt from the tokens routed to that expert.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from powerinfer.errors import PowerInferError
from powerinfer.models.base import CausalLM
from powerinfer.ops.linear import DenseLinear
from powerinfer.outputs import OwnedNames, atomic_directory
from powerinfer.runtime.engine import Engine
from powerinfer.sparse.folders import load_json, load_torch_file, numbered_files
from powerinfer.sparse.predictor import Predictor
from powerinfer.sparse.profiler import calibration_chunks, observe_ffn
from powerinfer.sparse.select import kept

SPLITS = (0.8, 0.1, 0.1)  # train, calibration (threshold), held-out (report)
COLLECT_BYTES = 4 << 30  # collected activations per pass over the text; more layers take more passes
CONFIG_FILE = "config.json"
PREDICTOR_FILES = OwnedNames(re.compile(r"model_\d+\.pt|config\.json"), "model_*.pt, config.json")


@dataclass(frozen=True)
class TrainingOptions:
    recall: float = 0.99
    ranks: tuple[int, ...] = (32, 64, 128, 256, 512)  # capped at n_ff
    rank_tolerance: float = 0.02  # a larger rank must gain at least this much predicted sparsity
    steps: int = 1000
    batch: int = 1024
    learning_rate: float = 1e-2
    seed: int = 0

    @property
    def calibration_recall(self) -> float:
        """The recall aimed at on the calibration part: half the allowed misses, a margin for
        text that the threshold was not chosen on."""
        return 1.0 - (1.0 - self.recall) / 2


@dataclass
class LayerReport:
    layer: int
    rank: int
    threshold: float
    recall: float
    precision: float
    true_sparsity: float
    predicted_sparsity: float


@dataclass
class TrainedPredictor:
    fc1: torch.Tensor  # [R, d]
    fc2: torch.Tensor  # [n_ff, R]
    threshold: float


# ---------------------------------------------------------------- data

@dataclass
class LayerData:
    """One layer's FFN inputs (float16) and which neurons fired (bool), split by token."""

    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    fired: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _split_sizes(n_chunks: int) -> tuple[int, int, int]:
    if n_chunks < 3:
        raise PowerInferError("text too short to train predictors: need at least 3 chunks (train, calibration, held-out)")
    calibration = max(1, round(n_chunks * SPLITS[1]))
    held_out = max(1, round(n_chunks * SPLITS[2]))
    return n_chunks - calibration - held_out, calibration, held_out


def collect_layers(model: CausalLM, chunks: list[list[int]], units: Sequence[int],
                   thresholds: Sequence[float]) -> dict[int, LayerData]:
    """Run the model over `chunks`, keeping the FFN input and the firing pattern of FFN `units`
    (each is shown once per chunk: an expert with the rows routed to it, maybe none)."""
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in units}
    fired: dict[int, list[torch.Tensor]] = {i: [] for i in units}

    def keep(unit: int, residual: torch.Tensor, a: torch.Tensor) -> None:
        if unit in inputs:
            inputs[unit].append(residual.to(torch.float16))
            fired[unit].append(kept(a.float(), thresholds[unit]))

    observe_ffn(model, Engine(model, max(len(c) for c in chunks)), chunks, keep,
                f"collecting FFN units {units[0]}-{units[-1]}")
    n_train, n_calibration, _ = _split_sizes(len(chunks))
    bounds = [0, n_train, n_train + n_calibration, len(chunks)]
    out = {}
    for i in units:
        parts = [(torch.cat(inputs[i][a:b]), torch.cat(fired[i][a:b])) for a, b in zip(bounds, bounds[1:])]
        if any(len(x) == 0 for x, _ in parts):
            raise PowerInferError(f"FFN unit {i} saw no tokens in a part of the text (an expert the router rarely "
                                  "picks): give more text")
        out[i] = LayerData(tuple(p[0] for p in parts), tuple(p[1] for p in parts))
        inputs[i], fired[i] = [], []
    return out


# ---------------------------------------------------------------- fitting

def _threshold_for_recall(scores: torch.Tensor, fired: torch.Tensor, recall: float) -> float:
    """The largest threshold keeping at least `recall` of the firing neurons (score >= threshold)."""
    positives = scores[fired]
    if positives.numel() == 0:
        return float(scores.max()) + 1.0  # nothing ever fires: predict nothing
    k = int(math.floor((1.0 - recall) * positives.numel()))  # positives we may miss
    return float(torch.kthvalue(positives.float(), k + 1).values) if k > 0 else float(positives.min())


def _float_predictor(fc1: torch.Tensor, fc2: torch.Tensor, threshold: float = 0.0) -> Predictor:
    """The predictor that runs in the engine, in float32: its scores are the ones it is judged by."""
    return Predictor(DenseLinear(fc1), DenseLinear(fc2), threshold)


def _fit(x: torch.Tensor, y: torch.Tensor, rank: int, options: TrainingOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1, fc2 fitted to predict y (bool [N, n_ff]) from x ([N, d]); fc1 takes unscaled inputs."""
    generator = torch.Generator().manual_seed(options.seed)
    scale = x.float().pow(2).mean(0).sqrt().clamp_min(1e-6)  # per-dimension RMS, folded into fc1 at the end
    d, n_ff = x.shape[1], y.shape[1]
    fc1 = torch.nn.Linear(d, rank, bias=False)
    fc2 = torch.nn.Linear(rank, n_ff, bias=False)
    with torch.no_grad():
        torch.nn.init.normal_(fc1.weight, std=1.0 / math.sqrt(d), generator=generator)
        torch.nn.init.normal_(fc2.weight, std=1.0 / math.sqrt(rank), generator=generator)
    params = [fc1.weight, fc2.weight]
    optimizer = torch.optim.AdamW(params, lr=options.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, options.learning_rate, total_steps=options.steps)
    # Firing neurons are the minority class in ReLU models; weigh them so that the recall target
    # does not push the threshold deep into the negatives.
    rate = y.float().mean(0).clamp(1e-4, 1 - 1e-4)
    pos_weight = ((1 - rate) / rate).clamp(max=10.0).sqrt()
    for _ in range(options.steps):
        rows = torch.randint(len(x), (min(options.batch, len(x)),), generator=generator)
        logits = fc2(F.relu(fc1(x[rows].float() / scale)))
        loss = F.binary_cross_entropy_with_logits(logits, y[rows].float(), pos_weight=pos_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return (fc1.weight.detach() / scale).contiguous(), fc2.weight.detach().contiguous()


def _evaluate(predictor: TrainedPredictor, x: torch.Tensor, fired: torch.Tensor) -> tuple[float, float, float, float]:
    """recall, precision, true sparsity, predicted sparsity of `predictor` on (x, fired)."""
    predicted = _float_predictor(predictor.fc1, predictor.fc2, predictor.threshold).fires(x)
    hits = float((predicted & fired).sum())
    n_fired, n_predicted = float(fired.sum()), float(predicted.sum())
    recall = hits / n_fired if n_fired else 1.0
    precision = hits / n_predicted if n_predicted else 1.0
    return recall, precision, 1.0 - n_fired / fired.numel(), 1.0 - n_predicted / fired.numel()


def train_layer(layer: int, data: LayerData, options: TrainingOptions) -> tuple[TrainedPredictor, LayerReport]:
    """Fit ranks from the smallest up and keep the first whose next candidate gains less than
    `rank_tolerance` of predicted sparsity (at the recall target, on the calibration part)."""
    (x_train, x_calibration, x_held_out), (y_train, y_calibration, y_held_out) = data.inputs, data.fired
    ranks = sorted({min(r, y_train.shape[1]) for r in options.ranks})

    def fitted(rank: int) -> tuple[float, TrainedPredictor]:
        fc1, fc2 = _fit(x_train, y_train, rank, options)
        threshold = _threshold_for_recall(_float_predictor(fc1, fc2).scores(x_calibration), y_calibration, options.calibration_recall)
        predictor = TrainedPredictor(fc1, fc2, threshold)
        return _evaluate(predictor, x_calibration, y_calibration)[3], predictor

    sparsity, chosen = fitted(ranks[0])
    for rank in ranks[1:]:
        larger_sparsity, larger = fitted(rank)
        if larger_sparsity < sparsity + options.rank_tolerance:
            break
        sparsity, chosen = larger_sparsity, larger
    recall, precision, true_sparsity, predicted_sparsity = _evaluate(chosen, x_held_out, y_held_out)
    report = LayerReport(layer, chosen.fc1.shape[0], chosen.threshold, recall, precision, true_sparsity,
                         predicted_sparsity)
    return chosen, report


def train_predictors(model: CausalLM, ids: Sequence[int], thresholds: Sequence[float], n_tokens: int | None = None,
                     chunk: int = 512, options: TrainingOptions = TrainingOptions(),
                     on_layer: Callable[[LayerReport], None] | None = None) -> tuple[list[TrainedPredictor], list[LayerReport]]:
    """Predictors for every FFN unit of `model` (each layer, or each expert), learnt from its
    activations over `ids`; a neuron fires when |activation| > thresholds[unit]."""
    config = model.config
    chunks = calibration_chunks(ids, n_tokens, chunk)
    _split_sizes(len(chunks))
    n_rows = sum(len(c) for c in chunks)
    per_unit = n_rows * (2 * config.n_embd + config.n_ff)  # an expert sees fewer rows: an upper bound
    n_units = config.n_ffn_units
    units_per_pass = max(1, min(n_units, COLLECT_BYTES // per_unit))
    predictors: list[TrainedPredictor] = []
    reports: list[LayerReport] = []
    for first in range(0, n_units, units_per_pass):
        units = list(range(first, min(first + units_per_pass, n_units)))
        collected = collect_layers(model, chunks, units, thresholds)
        for i in tqdm(units, desc="training", unit="unit"):
            predictor, report = train_layer(i, collected.pop(i), options)
            predictors.append(predictor)
            reports.append(report)
            if on_layer is not None:
                on_layer(report)
    return predictors, reports


# ---------------------------------------------------------------- PowerInfer's predictor directory

def save_predictors(directory: str | Path, predictors: Sequence[TrainedPredictor],
                    reports: Sequence[LayerReport] = (), activation_thresholds: Sequence[float] | None = None,
                    replace: bool = True) -> None:
    """Write model_{i}.pt (fc1.weight [R, d], fc2.weight [n_ff, R]) and config.json, atomically
    (into a non-empty folder only when `replace`, and then touching only those names).

    config.json's `sparse_threshold` (PowerInfer's single threshold) is the lowest of the layer
    thresholds, so that tools reading only it still meet the recall target everywhere;
    `layer_thresholds` holds ours, and `files` each model file's SHA-256: a set whose files
    disagree (files of two runs mixed) is refused when read."""
    layer_thresholds = [p.threshold for p in predictors]
    config = {"sparse_threshold": min(layer_thresholds), "layer_thresholds": layer_thresholds}
    if activation_thresholds is not None:
        config["activation_thresholds"] = list(activation_thresholds)
    if reports:
        config["report"] = [asdict(r) for r in reports]
    with atomic_directory(directory, PREDICTOR_FILES, replace) as staging:
        config["files"] = {}
        for i, p in enumerate(predictors):
            path = staging / f"model_{i}.pt"
            torch.save({"fc1.weight": p.fc1.to(torch.float16), "fc2.weight": p.fc2.to(torch.float16)}, path)
            config["files"][path.name] = file_digest(path)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=1))


def file_digest(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def check_one_set(directory: Path, paths: Sequence[Path], config: dict) -> None:
    """Refuse model files that are not the ones config.json lists (a set mixed from two runs, or
    partly replaced); PowerInfer's own sets list none and are taken as they are."""
    listed = config.get("files")
    if listed is None:
        return
    if not isinstance(listed, dict) or sorted(listed) != sorted(path.name for path in paths):
        raise PowerInferError(f"{directory}: the model files differ from those {CONFIG_FILE} lists (a mixed set); "
                              "train the predictors again")
    for path in paths:
        if file_digest(path) != listed[path.name]:
            raise PowerInferError(f"{path}: not the file {CONFIG_FILE} lists (predictor files from different runs "
                                  "are mixed); train the predictors again")


@dataclass
class PredictorDirectory:
    fc1: list[torch.Tensor]
    fc2: list[torch.Tensor]
    sparse_threshold: float
    layer_thresholds: list[float] | None
    activation_thresholds: list[float] | None
    predicted_sparsity: list[float] | None = None  # per layer, on held-out tokens (our training report)

    def check_matches(self, n_layers: int, n_embd: int, n_ff: int, where: str) -> None:
        if len(self.fc1) != n_layers:
            raise PowerInferError(f"{where}: predictors for {len(self.fc1)} layers, the model has {n_layers}")
        for i, (fc1, fc2) in enumerate(zip(self.fc1, self.fc2)):
            if fc1.ndim != 2 or fc2.ndim != 2 or fc1.shape[1] != n_embd or fc2.shape != (n_ff, fc1.shape[0]):
                raise PowerInferError(f"{where}: predictor {i} has shapes {tuple(fc1.shape)}, {tuple(fc2.shape)}; "
                                      f"the model needs [R, {n_embd}] and [{n_ff}, R]")


def load_predictors(directory: str | Path) -> PredictorDirectory:
    """Read a predictor directory (ours or PowerInfer's)."""
    directory = Path(directory)
    fc1, fc2 = [], []
    paths = numbered_files(directory, "model")
    for path in paths:
        state = load_torch_file(path)
        weights = [state.get(key) if isinstance(state, dict) else None for key in ("fc1.weight", "fc2.weight")]
        if not all(isinstance(w, torch.Tensor) and w.is_floating_point() for w in weights):
            raise PowerInferError(f"{path}: not a predictor state dict (float fc1.weight and fc2.weight)")
        fc1.append(weights[0].float())
        fc2.append(weights[1].float())
    config = load_json(directory / CONFIG_FILE)
    check_one_set(directory, paths, config)  # after reading each: a damaged file is named as such
    report = config.get("report")
    predicted = [float(r["predicted_sparsity"]) for r in report] if isinstance(report, list) and \
        all(isinstance(r, dict) and isinstance(r.get("predicted_sparsity"), (int, float)) for r in report) else None
    return PredictorDirectory(fc1, fc2, float(config.get("sparse_threshold", 0.0)), config.get("layer_thresholds"),
                              config.get("activation_thresholds"), predicted)
