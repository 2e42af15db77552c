"""What goes to the accelerator: a `Placement` (chosen by `planner`, applied by `apply`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from powerinfer.placement.solver import Plan


@dataclass(frozen=True)
class DensePlacement:
    """Which dense parts live on the accelerator: blocks (attention, norms, predictor, KV cache) and
    the output head."""

    layers: frozenset[int]
    output: bool
    bytes_used: int

    def summary(self, n_layers: int) -> str:
        return (f"dense parts of {len(self.layers)}/{n_layers} blocks{' and the output head' if self.output else ''} "
                f"there ({self.bytes_used / (1 << 20):.1f} MiB)")


NOTHING_DENSE = DensePlacement(frozenset(), False, 0)


def no_hot_neurons(n_ff: tuple[int, ...]) -> Plan:
    return Plan(tuple(np.zeros(0, dtype=np.int32) for _ in n_ff), n_ff, 0, 0, None, None, None, None)


@dataclass(frozen=True)
class Placement:
    """What goes to the accelerator `device`: the blocks' dense parts (norms, attention, KV cache,
    predictor) and the output head in `dense`, each layer's hot neurons in `plan`, and the layers in
    `whole` entirely, their FFNs dense (layer offload)."""

    device: torch.device
    plan: Plan
    dense: DensePlacement = NOTHING_DENSE
    whole: frozenset[int] = frozenset()

    def offloads(self, layer: int) -> bool:
        """Whether block `layer`'s dense parts live on the accelerator."""
        return layer in self.dense.layers

    def has_hot(self, unit: int) -> bool:
        """Whether FFN unit `unit` (a layer's FFN, or an expert: `ModelConfig.ffn_unit`) has neurons there."""
        return len(self.plan.hot[unit]) > 0


    def summary(self, n_layers: int) -> str:
        if self.whole:
            head = " and the output head" if self.dense.output else ""
            return f"{len(self.whole)}/{n_layers} layers offloaded whole{head} ({self.dense.bytes_used / (1 << 20):.1f} MiB)"
        return f"{self.plan.summary()}; {self.dense.summary(n_layers)}"
