"""PowerInfer's per-layer activation predictor, read from a PowerInfer GGUF (`blk.N.fc1`, `blk.N.fc2`;
per expert of a mixture of experts `blk.N.fc1.E`, `blk.N.fc2.E`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powerinfer.errors import ModelFileError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.ops.linear import DenseLinear, Linear, build_linear, dequantized
from powerinfer.ops.quant import FLOAT_TYPES

LAYER_THRESHOLDS_KEY = "powerinfer.layer_sparse_thresholds"  # ours: predictor score thresholds per FFN unit
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"  # PowerInfer's: one predictor score threshold
PREDICTED_SPARSITY_KEY = "powerinfer.layer_predicted_sparsity"  # ours: neurons the predictors rule out, per FFN unit
# A SiLU/GELU FFN's predictor pays only where it rules out at least this share of the neurons: below
# it the predictor and the neuron records cost more than the skipped neurons save (SmolLM2's rule out
# 4.9 % and decoded at 0.73x dense).
MIN_GATED_PREDICTED_SPARSITY = 0.3


class Predictor:
    """scores = fc2(relu(fc1(x))); a neuron is predicted to fire when its score is >= the threshold."""

    def __init__(self, fc1: Linear, fc2: Linear, threshold: float):
        self.fc1, self.fc2, self.threshold = fc1, fc2, threshold

    @classmethod
    def from_weights(cls, fc1: torch.Tensor, fc2: torch.Tensor, threshold: float) -> Predictor:
        """From float matrices fc1 [R, d] and fc2 [n_ff, R], held in bfloat16: torch's fast CPU matmul
        for one row (the predictor reads as many bytes per token as a good share of the neurons it saves)."""
        return cls(DenseLinear(fc1.to(torch.bfloat16)), DenseLinear(fc2.to(torch.bfloat16)), threshold)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x.float())).float()).float()

    def fires(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n_ff] bool: which neurons each row of x is predicted to fire."""
        return self.scores(x) >= self.threshold

    def to(self, device: torch.device) -> Predictor:
        return Predictor(self.fc1.to(device), self.fc2.to(device), self.threshold)

    @property
    def nbytes(self) -> int:
        return self.fc1.nbytes + self.fc2.nbytes


def predictor_name(layer: int, part: str, expert: int | None = None) -> str:
    """The tensor of predictor part "fc1" or "fc2" for block `layer`'s FFN (PowerInfer's name) or, in
    a mixture of experts, for its expert `expert` (the expert's number after the part, as llama.cpp
    numbers per-expert tensors)."""
    return f"blk.{layer}.{part}.weight" if expert is None else f"blk.{layer}.{part}.{expert}.weight"


def has_predictors(gguf: GGUFFile) -> bool:
    return predictor_name(0, "fc1") in gguf.tensors or predictor_name(0, "fc1", 0) in gguf.tensors


def predictor_pays(gguf: GGUFFile, unit: int, relu_family: bool) -> bool:
    """Whether FFN unit `unit` is faster on its predictor than dense: always for ReLU-family models
    (most neurons are exactly zero), for others only where the file records that the predictor rules
    out enough neurons (MIN_GATED_PREDICTED_SPARSITY; a file without the record runs them dense)."""
    if relu_family:
        return True
    predicted = gguf.get(PREDICTED_SPARSITY_KEY)
    return predicted is not None and float(predicted[unit]) >= MIN_GATED_PREDICTED_SPARSITY


def load_predictor(gguf: GGUFFile, layer: int, expert: int | None = None, unit: int | None = None,
                   shape: tuple[int, int] | None = None) -> Predictor:
    """The predictor of block `layer`'s FFN (or its expert `expert`); `unit`: its index among the
    model's FFN units, which the per-unit thresholds follow (default: `layer`); `shape`: the FFN's
    (n_embd, n_ff), which fc1 [R, n_embd] and fc2 [n_ff, R] must match (refused at load, not at the
    first token)."""
    thresholds = gguf.get(LAYER_THRESHOLDS_KEY)
    unit = layer if unit is None else unit
    threshold = float(thresholds[unit]) if thresholds else float(gguf.get(SPARSE_THRESHOLD_KEY, 0.0))
    fc1, fc2 = (gguf.tensor(predictor_name(layer, part, expert)) for part in ("fc1", "fc2"))
    if len(fc1.shape) != 2 or len(fc2.shape) != 2 or fc2.shape[1] != fc1.shape[0] or \
            (shape is not None and (fc1.shape[1], fc2.shape[0]) != shape):
        wanted = "[R, n_embd] and [n_ff, R]" if shape is None else f"[R, {shape[0]}] and [{shape[1]}, R]"
        raise ModelFileError(f"{gguf.path}: predictor {predictor_name(layer, 'fc1', expert)} and fc2 have shapes "
                             f"{list(fc1.shape)} and {list(fc2.shape)}; the FFN needs {wanted}")
    if fc1.ggml_type in FLOAT_TYPES and fc2.ggml_type in FLOAT_TYPES:
        return Predictor.from_weights(dequantized(fc1), dequantized(fc2), threshold)
    # quantized, as PowerInfer's own quantizer writes them (Q4_0): kept compact, on our kernels
    return Predictor(build_linear([fc1]), build_linear([fc2]), threshold)
