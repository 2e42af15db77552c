"""Hybrid execution: each FFN's hot neurons on the accelerator, its cold neurons on the CPU.

The accelerator keeps the hot neurons' records in the CPU store's own encoding (Q4_0/Q4_1/Q8_0
blocks or float32): VRAM is the scarce resource, so it holds as many neurons as the plan counted,
and the rows a token needs are gathered and dequantized there. Per token only activations cross
the bus: h goes over, the partial output comes back. The accelerator's work is queued first (CUDA
runs it asynchronously), the CPU computes the cold neurons meanwhile, and copying the result back
is the synchronisation point.

The accelerator is any `torch.device`; with device "cpu" the same code runs on the CPU, which is
how the split, the merge and the index handling are tested on machines without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch

from powerinfer.config import ModelConfig
from powerinfer.errors import PowerInferError
from powerinfer.gguf.reader import GGUFFile
from powerinfer.models.ffn import MAX_SPARSE_ROWS, SparseFFN
from powerinfer.ops.activation import activate
from powerinfer.ops.neuron import (NeuronStore, accumulate_rows, dequantize_records, gather_matvec,
                                   matvec_records, sparse_ffn)
from powerinfer.placement.costs import GiB
from powerinfer.placement.planner import Warn, plan_for_model, stderr_note
from powerinfer.placement.solver import Plan

GPUIndexMode = Literal["reuse", "reset", "disable"]
CHUNK_NEURONS = 4096  # neurons dequantized at a time when all hot neurons are computed (bounds temporaries)


class DeviceNeurons:
    """The records of some neurons of a store, on the accelerator."""

    def __init__(self, store: NeuronStore, ids: torch.Tensor, device: torch.device):
        self.records = store.records[ids].to(device)
        self.up_bias = None if store.up_bias is None else store.up_bias[ids].to(device)
        self.gate, self.up, self.down = store.gate, store.up, store.down
        self.device = device

    @property
    def nbytes(self) -> int:
        return self.records.nbytes

    def ffn(self, x: torch.Tensor, activation, rows: torch.Tensor | None = None, threshold: float | None = None,
            mask: torch.Tensor | None = None, many: bool = False) -> torch.Tensor | None:
        """FFN output [m, d] over the neurons at positions `rows` (all when None) for x [m, d] on the
        device. Activations with |a| <= `threshold` (oracle mode), or where `mask` [m, neurons] is
        False (the predictor's per-row choice), are left out. None when there are no neurons.

        The arithmetic is the CPU path's: the native kernels' for a few rows (`matvec_records`, their
        reference), SparseFFN's bfloat16 products for `many` rows; so the split changes no result.
        """
        records = self.records if rows is None else self.records.index_select(0, rows)
        up_bias = self.up_bias if rows is None or self.up_bias is None else self.up_bias[rows]
        y = None
        for start in range(0, records.shape[0], CHUNK_NEURONS):
            chunk = records[start : start + CHUNK_NEURONS]
            up = self._products(chunk, self.up, x, many)
            if up_bias is not None:
                up = up + up_bias[start : start + CHUNK_NEURONS]
            if self.gate is not None:
                up = torch.cat([self._products(chunk, self.gate, x, many), up], dim=-1)
            a = activate(up, activation)
            if threshold is not None:
                a = a * (a.abs() > threshold)
            if mask is not None:
                a = a * mask[:, start : start + CHUNK_NEURONS]
            down = dequantize_records(chunk, self.down)
            # SparseFFN._dense: the very products the CPU runs for many rows
            part = SparseFFN._dense(a, down if self.down.bits == 32 else down.to(torch.bfloat16)) if many else a @ down
            y = part if y is None else y.add_(part)
        return y

    @staticmethod
    def _products(chunk: torch.Tensor, section, x: torch.Tensor, many: bool) -> torch.Tensor:
        """x times the `section` rows of the records in `chunk`: [m, len(chunk)]."""
        if not many:
            return matvec_records(chunk, section, x)
        weights = dequantize_records(chunk, section)
        return SparseFFN._dense(x, (weights if section.bits == 32 else weights.to(torch.bfloat16)).T)


class HybridFFN(SparseFFN):
    """A SparseFFN whose neurons `hot` (sorted ids) are computed on `device`, the rest on the CPU.

    `activations` and `project` (used by profiling) stay on the CPU over the full store.
    """

    def __init__(self, ffn: SparseFFN, hot: torch.Tensor, device: torch.device):
        super().__init__(ffn.store, ffn.activation, ffn.mode, ffn.predictor, ffn.threshold)
        n_ff = ffn.store.n_ff
        self.is_hot = torch.zeros(n_ff, dtype=torch.bool)
        self.is_hot[hot] = True
        self.position = torch.full((n_ff,), -1, dtype=torch.int64)  # neuron id -> row on the device
        self.position[hot] = torch.arange(len(hot))
        self.hot, self.cold = hot, torch.nonzero(~self.is_hot).flatten()
        self.accelerator = DeviceNeurons(ffn.store, hot, device)

    @property
    def n_hot(self) -> int:
        return int(self.accelerator.records.shape[0])

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        device = self.accelerator.device
        x = h.float().to(device, non_blocking=True)
        # Each branch queues the accelerator's part first, then computes the CPU's.
        if h.shape[0] > MAX_SPARSE_ROWS:  # prefill: dense products, skipped neurons zeroed per row
            self.last_active = self.store.n_ff
            threshold = self.threshold if self.mode == "oracle" else None
            keep = self.fired(None, h, residual) if self.mode == "auto" else None  # predictor: needs no a
            hot_part = self.accelerator.ffn(x, self.activation, None, threshold,
                                            None if keep is None else keep[:, self.hot].to(device), many=True)
            cold_part = self._cold_dense(h, threshold, None if keep is None else keep[:, self.cold])
        elif self.mode == "off":
            self.last_active = self.store.n_ff
            hot_part = self.accelerator.ffn(x, self.activation)
            cold_part = self._cold_sparse(h, self.cold)
        elif self.mode == "oracle":
            hot_part = self.accelerator.ffn(x, self.activation, threshold=self.threshold)
            cold_part = self._cold_oracle(h)
        else:
            idx = self.predictor.active(h if residual is None else residual)
            self.last_active = len(idx)
            hot_mask = self.is_hot[idx]
            rows = self.position[idx[hot_mask]]
            hot_part = self.accelerator.ffn(x, self.activation, rows.to(device)) if len(rows) else None
            cold_part = self._cold_sparse(h, idx[~hot_mask])
        if hot_part is None:
            y = cold_part if cold_part is not None else torch.zeros(h.shape[0], self.store.dim_out)
        else:
            hot_part = hot_part.to(h.device)  # waits for the accelerator
            y = hot_part if cold_part is None else cold_part.add_(hot_part)
        return self.store.add_down_bias(y)

    def _cold_dense(self, h: torch.Tensor, threshold: float | None, keep: torch.Tensor | None) -> torch.Tensor | None:
        """Many rows: SparseFFN's dense products over the cold neurons, skipped ones zeroed."""
        if len(self.cold) == 0:
            return None
        s = self.store
        up = s.add_up_bias(self._dense(h, self._weights(s.up, self.cold).T), self.cold)
        if s.gate is not None:
            up = torch.cat([self._dense(h, self._weights(s.gate, self.cold).T), up], dim=-1)
        a = activate(up, self.activation)
        if threshold is not None:
            a = a * (a.abs() > threshold)
        if keep is not None:
            a = a * keep
        return self._dense(a, self._weights(s.down, self.cold))

    def _cold_oracle(self, h: torch.Tensor) -> torch.Tensor | None:
        s, cold = self.store, self.cold
        if len(cold) == 0:
            self.last_active = self.n_hot
            return None
        up = s.add_up_bias(gather_matvec(s, s.up, h, cold), cold)
        if s.gate is not None:
            up = torch.cat([gather_matvec(s, s.gate, h, cold), up], dim=-1)
        a = activate(up, self.activation)
        fired = a.abs() > self.threshold
        keep = torch.nonzero(fired.any(0) if fired.shape[0] > 1 else fired[0]).flatten()
        self.last_active = self.n_hot + len(keep)  # the accelerator computes all its neurons
        if len(keep) == 0:
            return torch.zeros(h.shape[0], s.dim_out)
        return accumulate_rows(s, s.down, (a * fired)[:, keep], cold[keep])

    def _cold_sparse(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        return sparse_ffn(self.store, self.activation, h, ids) if len(ids) else None

    @property
    def device_nbytes(self) -> int:
        return self.accelerator.nbytes


@dataclass(frozen=True)
class HybridOptions:
    """Where each layer's hot neurons go (`FFNOptions.hybrid`)."""

    device: torch.device
    plan: Plan

    def wrap(self, ffn: SparseFFN, layer: int) -> SparseFFN:
        hot = self.plan.hot[layer]
        if len(hot) == 0:
            return ffn
        return HybridFFN(ffn, torch.from_numpy(hot).long(), self.device)

    def has_hot(self, layer: int) -> bool:
        return len(self.plan.hot[layer]) > 0


def accelerator_device(accelerator: str | torch.device | None) -> torch.device | None:
    """The device hot neurons go to: as asked, else CUDA when present, else None (all on the CPU)."""
    if accelerator is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        device = torch.device(accelerator)
    except RuntimeError:
        raise PowerInferError(f"unknown accelerator device {accelerator!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PowerInferError(f"accelerator {accelerator!r} asked for, but torch sees no CUDA device")
    return device


def hybrid_options(gguf: GGUFFile, config: ModelConfig, model_path: str | os.PathLike[str], n_ctx: int,
                   vram_budget: float, *, gpu_index: GPUIndexMode = "reuse",
                   activations: str | os.PathLike[str] | None = None, accelerator: str | torch.device | None = None,
                   note: Warn = stderr_note) -> HybridOptions | None:
    """The placement for a VRAM budget in GiB, or None when everything runs on the CPU (no
    accelerator, or the GPU index disabled), each case said in one line through `note`."""
    if vram_budget < 0:
        raise PowerInferError(f"VRAM budget must be >= 0 GiB, got {vram_budget}")
    if gpu_index not in ("reuse", "reset", "disable"):
        raise PowerInferError(f"unknown GPU index mode {gpu_index!r} (expected 'reuse', 'reset' or 'disable')")
    device = accelerator_device(accelerator)
    if device is None:
        note("no CUDA device: the VRAM budget is ignored and everything runs on the CPU")
        return None
    if gpu_index == "disable":
        note("GPU index disabled: FFN neurons run on the CPU")
        return None
    plan = plan_for_model(gguf, config, model_path, n_ctx, int(vram_budget * GiB), index=gpu_index,
                          activations=activations, note=note)
    note(f"placement on {device}: {plan.summary()}")
    return HybridOptions(device, plan)
