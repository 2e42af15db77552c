"""FFN neuron activations from the up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from powerinfer.config import FFNActivation


def activate(up_out: torch.Tensor, activation: FFNActivation) -> torch.Tensor:
    """Neuron activations from the up-projection output ([gate, up] halves when gated)."""
    if not activation.is_gated:
        return F.relu(up_out) if activation == FFNActivation.RELU else F.gelu(up_out, approximate="tanh")
    half = up_out.shape[-1] // 2
    gate, up = up_out[:, :half], up_out[:, half:]
    if activation == FFNActivation.SILU_GATED:
        return F.silu(gate).mul_(up)
    if activation == FFNActivation.RELU_GATED:
        return F.relu(gate).mul_(up)
    if activation == FFNActivation.DRELU:
        return F.relu(gate).mul_(F.relu(up))
    return F.gelu(gate, approximate="tanh").mul_(up)
