"""Mixture of experts (Mixtral): a router picks `n_used` of a layer's experts for each token and
mixes their outputs, weighted by the softmax of the chosen experts' router logits.

Each expert is an ordinary FFN (`DenseFFN` or `SparseFFN` over its own neurons), and each
(layer, expert) is an FFN unit of its own (`ModelConfig.ffn_unit`): profiling counts an expert's
neurons over the tokens routed to it, its predictor reads those tokens' residuals, and placement
can give an expert hot neurons like any layer's FFN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from powerinfer.config import ModelConfig
from powerinfer.gguf.reader import GGUFFile
from powerinfer.ops.linear import CPU, Linear
from powerinfer.options import FFNOptions
from powerinfer.sparse.ffn import DenseFFN, FFNTensors, SparseFFN, build_ffn, input_sparse_ffn
from powerinfer.sparse.storage import is_sparsified, projection_builder

Expert = DenseFFN | SparseFFN
Run = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]  # (expert, h rows, residual rows) -> output rows


class MoEFFN:
    """A layer's experts behind a router (Linear n_embd -> n_expert) on `device`, where it computes
    whatever device its input comes from (the block's, when placement moved the block and split
    the experts) and returns its result to. `first_unit`: the FFN unit number of expert 0 (the
    others follow)."""

    def __init__(self, router: Linear, experts: list[Expert], n_used: int, first_unit: int, device: torch.device = CPU):
        self.router, self.experts, self.n_used, self.first_unit = router, experts, n_used, first_unit
        self.device = device
        self.activation = experts[0].activation

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [rows, n_used]: each row's chosen experts and their mixing weights."""
        top, chosen = self.router(h).float().topk(self.n_used, dim=-1)
        return torch.softmax(top, dim=-1), chosen

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        residual = h if residual is None else residual
        y = self._mix(h.to(self.device), residual.to(self.device), lambda e, x, r: self.experts[e](x, r))
        return y.to(h.device)

    def observed(self, h: torch.Tensor, residual: torch.Tensor, observer, unit: int) -> torch.Tensor:
        """The output, each expert's activations on its own rows shown to observer(expert's unit,
        residual rows, activations). Every expert is shown once per call, with no rows when none
        chose it, so observers see each unit once per forward pass (`unit` is the layer's; the
        experts' units are this mixture's own)."""
        def run(e: int, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
            expert = self.experts[e]
            if len(x) == 0:
                observer(self.first_unit + e, r, torch.zeros(0, expert.n_ff))
                return torch.zeros(0, h.shape[1])
            return expert.observed(x, r, observer, self.first_unit + e)

        return self._mix(h, residual, run, every_expert=True)

    def _mix(self, h: torch.Tensor, residual: torch.Tensor, run: Run, every_expert: bool = False) -> torch.Tensor:
        weights, chosen = self.route(h)
        if h.shape[0] == 1 and not every_expert:  # one token (decode): its experts, one call each
            y = None
            for weight, e in zip(weights[0].tolist(), chosen[0].tolist()):
                part = run(e, h, residual).float().mul_(weight)
                y = part if y is None else y.add_(part)
            return y
        y = torch.zeros(h.shape[0], h.shape[1], device=h.device)
        for e in range(len(self.experts)):
            rows, rank = torch.nonzero(chosen == e, as_tuple=True)
            if len(rows) or every_expert:
                out = run(e, h[rows], residual[rows]).float()
                y.index_add_(0, rows, out * weights[rows, rank, None])
        return y

    native_projections = None  # the native decode step hands the mixture its input

    def dense(self) -> MoEFFN:
        """The same router over its experts' dense forms."""
        return self.with_experts([e.dense() for e in self.experts])

    def with_experts(self, experts: list) -> MoEFFN:
        """The same router over other experts (placement's hybrid or dense forms of them)."""
        return MoEFFN(self.router, experts, self.n_used, self.first_unit, self.device)

    def to(self, device: torch.device) -> MoEFFN:
        """The router and the (dense) experts on `device`."""
        return MoEFFN(self.router.to(device), [e.to(device) for e in self.experts], self.n_used, self.first_unit, device)

    @property
    def nbytes(self) -> int:
        """Bytes read per token: the router and `n_used` experts of average size."""
        return self.router.nbytes + self.n_used * sum(e.nbytes for e in self.experts) // len(self.experts)


def expert_tensors(gguf: GGUFFile, layer: int, config: ModelConfig) -> list[FFNTensors]:
    return [FFNTensors.read_expert(gguf, layer, e, config.activation) for e in range(config.n_expert)]


def ffn_unit_tensors(gguf: GGUFFile, config: ModelConfig) -> list[FFNTensors]:
    """Every FFN unit's weights in unit order: one FFN per layer, or each layer's experts."""
    if not config.n_expert:
        return [FFNTensors.read(gguf, i, config.activation) for i in range(config.n_layers)]
    return [t for i in range(config.n_layers) for t in expert_tensors(gguf, i, config)]


def layer_ffn(gguf: GGUFFile, layer: int, config: ModelConfig, options: FFNOptions) -> DenseFFN | SparseFFN | MoEFFN:
    """Block `layer`'s FFN: one FFN, or its experts behind their router when the model has experts."""
    if is_sparsified(gguf):  # sparsify refuses mixtures of experts
        return input_sparse_ffn(gguf, layer, config.activation, options)
    if not config.n_expert:
        return build_ffn(gguf, FFNTensors.read(gguf, layer, config.activation), layer, options)
    router = projection_builder(gguf, options)(f"blk.{layer}.ffn_gate_inp.weight")
    experts = [build_ffn(gguf, t, config.ffn_unit(layer, t.expert), options) for t in expert_tensors(gguf, layer, config)]
    return MoEFFN(router, experts, config.n_expert_used, config.ffn_unit(layer, 0))
