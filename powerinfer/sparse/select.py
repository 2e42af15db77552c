"""Which neurons or input channels each row computes.

One rule decides what a threshold keeps: a value whose magnitude exceeds it (`kept`). Input-sparse
linears apply it to their input channels (sites.py, columns.py); the neuron path applies it to
activations ("oracle"), or lets a predictor choose ("auto"), or computes every neuron ("off"). Each
of those is a `Selector`, named by its sparsity mode (powerinfer.options.SparsityMode).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from powerinfer.options import SparsityMode
from powerinfer.sparse.predictor import Predictor


def kept(values: torch.Tensor, thresholds: torch.Tensor | float) -> torch.Tensor:
    """Which values a threshold keeps (bool, values' shape): those with |value| > threshold, so a
    threshold of 0 keeps every non-zero value (ReLU-family activations: the exact result)."""
    return values.abs() > thresholds


def selected(x: torch.Tensor, thresholds: torch.Tensor | float) -> torch.Tensor:
    """x with what the thresholds skip set to 0."""
    return x * kept(x, thresholds)


class Selector:
    """Which neurons each row of an FFN computes. `fired(a, residual)`: [rows, n_ff] bool, or None
    for every neuron; `a` (the activations of every neuron) is given only to a selector that
    chooses `from_activations`, `residual` (the block input before the FFN norm) to any."""

    mode: ClassVar[SparsityMode]
    from_activations: ClassVar[bool] = False
    predictor: Predictor | None = None

    def fired(self, a: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor | None:
        return None

    def to(self, device: torch.device) -> Selector:
        """This selector computing on `device`."""
        return self

    @property
    def nbytes(self) -> int:
        """Bytes the choice reads per token."""
        return 0


class AllNeurons(Selector):
    mode = "off"


class AboveThreshold(Selector):
    """The neurons whose |activation| exceeds `threshold`: every activation is computed, the others
    are skipped in the down projection."""

    mode = "oracle"
    from_activations = True

    def __init__(self, threshold: float):
        self.threshold = threshold

    def fired(self, a: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        return kept(a, self.threshold)


class Predicted(Selector):
    """The neurons the predictor expects to fire, from the residual."""

    mode = "auto"

    def __init__(self, predictor: Predictor):
        self.predictor = predictor

    def fired(self, a: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        return self.predictor.fires(residual)

    def to(self, device: torch.device) -> Predicted:
        return Predicted(self.predictor.to(device))

    @property
    def nbytes(self) -> int:
        return self.predictor.nbytes
