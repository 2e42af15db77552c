"""An FFN split between two devices: each FFN's hot neurons on the accelerator, cold ones on the CPU.

Placement (`powerinfer.placement.apply`) wraps a layer's `SparseFFN` in a `HybridFFN`. When the
block's dense parts are on the accelerator too, the residual stream stays there: the hybrid FFN gets
its input there, sends only the FFN input and the predictor's choice to the CPU (the one
synchronisation of the layer), queues the hot neurons' work, computes the cold neurons on the CPU
meanwhile, and merges the two parts on the accelerator. Per token only activations cross the bus,
never weights.

Hot neurons are held in one of two layouts (`placement.costs.model_shape` counts the bytes of
each): on CUDA as `KernelNeurons` (gate and up rows for torch's int4 kernel, down rows in float16,
all computed each token and the unchosen ones masked: fixed shapes, a handful of launches); on any
other device as `RecordNeurons`, the CPU store's own records computed in its kernels' arithmetic,
so that with the CPU standing in for the accelerator a split changes no result. That is how the
split, the merge and the index handling are tested on machines without a GPU.
"""

from __future__ import annotations

import torch

from powerinfer.ops.linear import CPU, ConcatLinear, DenseLinear, Linear, pack_int4, q8_as_nibbles
from powerinfer.sparse.ffn import MAX_SPARSE_ROWS, SparseFFN, union
from powerinfer.sparse.neurons import (
    RAW,
    NeuronStore,
    Section,
    accumulate_rows,
    activate,
    dequantize_records,
    matvec_records,
    neuron_activations,
    q4_section,
    q8_section,
    sparse_ffn,
)
from powerinfer.sparse.select import Selector

CHUNK_NEURONS = 4096  # records dequantized at a time (bounds temporaries)


class RecordNeurons:
    """Some neurons of a store as the store's own records, on any device, computed in the CPU
    kernels' arithmetic (`matvec_records`, their reference) for a few rows and in SparseFFN's
    bfloat16 products for `many` rows: so the split changes no result."""

    def __init__(self, store: NeuronStore, ids: torch.Tensor, device: torch.device):
        self.records = store.records[ids].to(device)
        self.up_bias = None if store.up_bias is None else store.up_bias[ids].to(device)
        self.gate, self.up, self.down = store.gate, store.up, store.down

    @property
    def nbytes(self) -> int:
        return self.records.nbytes

    def ffn(self, x: torch.Tensor, activation, mask: torch.Tensor | None = None, chooser: Selector | None = None,
            many: bool = False) -> torch.Tensor:
        """FFN output [m, d] of these neurons for x [m, d]: activations that `chooser` (a selector that
        chooses from them) skips, or where `mask` [m or 1, neurons] is False (the predictor's
        choice), left out."""
        y = None
        for start in range(0, self.records.shape[0], CHUNK_NEURONS):
            chunk = slice(start, start + CHUNK_NEURONS)
            records = self.records[chunk]
            up = self._products(records, self.up, x, many)
            if self.up_bias is not None:
                up = up + self.up_bias[chunk]
            if self.gate is not None:
                up = torch.cat([self._products(records, self.gate, x, many), up], dim=-1)
            a = _skip(activate(up, activation), chooser, None if mask is None else mask[:, chunk])
            down = dequantize_records(records, self.down)
            # SparseFFN._dense: the very products the CPU runs for many rows
            part = SparseFFN._dense(a, down if self.down.bits == 32 else down.to(torch.bfloat16)) if many else a @ down
            y = part if y is None else y.add_(part)
        return y

    @staticmethod
    def _products(records: torch.Tensor, section: Section, x: torch.Tensor, many: bool) -> torch.Tensor:
        """x times the `section` rows of `records`: [m, len(records)]."""
        if not many:
            return matvec_records(records, section, x)
        weights = dequantize_records(records, section)
        return SparseFFN._dense(x, (weights if section.bits == 32 else weights.to(torch.bfloat16)).T)


class _SectionRows:
    """One section of some neuron records, as `pack_int4` reads its sources (rows by range)."""

    def __init__(self, records: torch.Tensor, section: Section):
        self.records, self.section = records, section
        self.shape = (records.shape[0], section.n_values)

    @staticmethod
    def int4(source: _SectionRows, start: int, end: int):
        rows = source.records[start:end]
        if source.section.bits == 4:
            return q4_section(rows, source.section)
        return q8_as_nibbles(*q8_section(rows, source.section))


def _section_projection(records: torch.Tensor, sections: list[Section], device: torch.device) -> Linear:
    """One projection over the `sections` rows of `records` (stacked), on `device`: torch's int4
    kernel for 4- and 8-bit rows (exact: the same values, scales and offsets), float32 otherwise."""
    bits = {s.bits for s in sections}
    if len(bits) > 1:
        return ConcatLinear([_section_projection(records, [s], device) for s in sections])
    if bits == {32}:
        return DenseLinear(torch.cat([dequantize_records(records, s) for s in sections]).to(device))
    if bits == {RAW}:  # block types torch's int4 kernel cannot hold exactly: bfloat16 (docs/hybrid.md)
        return DenseLinear(torch.cat([dequantize_records(records, s) for s in sections]).to(device, torch.bfloat16))
    return pack_int4([_SectionRows(records, s) for s in sections], _SectionRows.int4,
                     input_repeats=2 if bits == {8} else 1, device=device)


class KernelNeurons:
    """Some neurons of a store as a CUDA accelerator holds them: gate and up rows as one projection
    on torch's int4 kernel, down rows in float16 (float32 for float files). Every token computes all
    of them and masks the unchosen ones: fixed shapes, a few kernel launches and no gather, which on
    a GPU costs less than reading only the chosen rows."""

    def __init__(self, store: NeuronStore, ids: torch.Tensor, device: torch.device):
        records = store.records[ids]
        self.n = len(ids)
        self.projection = _section_projection(records, [s for s in (store.gate, store.up) if s is not None], device)
        down = dequantize_records(records, store.down)
        self.down = down.to(device, torch.float32 if store.down.bits == 32 else torch.float16)
        self.up_bias = None if store.up_bias is None else store.up_bias[ids].to(device)

    @property
    def nbytes(self) -> int:
        return self.projection.nbytes + self.down.nbytes

    def ffn(self, x: torch.Tensor, activation, mask: torch.Tensor | None = None, chooser: Selector | None = None,
            many: bool = False) -> torch.Tensor:
        """As `RecordNeurons.ffn`, in the int4 kernel's arithmetic (bfloat16 inputs)."""
        up = self.projection(x).float()
        if self.up_bias is not None:
            up[:, -self.n :] += self.up_bias
        a = _skip(activate(up, activation), chooser, mask)
        return (a.to(self.down.dtype) @ self.down).float()


def _skip(a: torch.Tensor, chooser: Selector | None, mask: torch.Tensor | None) -> torch.Tensor:
    if chooser is not None:
        a = a * chooser.fired(a, None)
    return a if mask is None else a * mask


def device_neurons(store: NeuronStore, ids: torch.Tensor, device: torch.device) -> RecordNeurons | KernelNeurons:
    return KernelNeurons(store, ids, device) if device.type == "cuda" else RecordNeurons(store, ids, device)


class HybridFFN(SparseFFN):
    """A SparseFFN whose neurons `hot` (sorted ids) are computed on `device`, the rest on the CPU.

    Input may come on the CPU or on `device` (`offloaded`: the block's dense parts, and with them
    the predictor, live there); the result goes back where the input came from. `activations` and
    `project` (used by profiling) stay on the CPU over the full store.
    """

    def __init__(self, ffn: SparseFFN, hot: torch.Tensor, device: torch.device, offloaded: bool = False):
        home = device if offloaded else CPU
        super().__init__(ffn.store, ffn.activation, ffn.selector.to(home), ffn.tensors)
        is_hot = torch.zeros(ffn.store.n_ff, dtype=torch.bool)
        is_hot[hot] = True
        self.hot, self.cold = hot, torch.nonzero(~is_hot).flatten()
        # the same ids where the predictor's choice is made
        self.hot_there, self.cold_there = self.hot.to(home), self.cold.to(home)
        self.device, self.n_hot = device, len(hot)
        self.last_on_accelerator = self.n_hot  # neurons the accelerator computed in the last call (statistics)
        self.accelerator = device_neurons(ffn.store, hot, device) if len(hot) else None
        self.down_bias = None if ffn.store.down_bias is None else ffn.store.down_bias.to(home)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        residual = h if residual is None else residual
        # a selector that chooses from the activations does so on each side; any other chooses first
        chooser = self.selector if self.selector.from_activations else None
        fires = None if chooser is not None else self.selector.fired(None, residual)
        if h.shape[0] > MAX_SPARSE_ROWS:  # prefill: dense products, skipped neurons zeroed per row
            self.last_active = self.store.n_ff
            hot = self._hot(h, None if fires is None else fires[:, self.hot_there], chooser, many=True)
            cold_keep = None if fires is None else fires[:, self.cold_there].cpu()
            return self._merge(h, hot, self._cold_dense(h.cpu(), chooser, cold_keep))
        if chooser is not None:
            return self._merge(h, self._hot(h, chooser=chooser), self._cold_oracle(h.cpu()))
        if fires is None:  # every neuron
            self.last_active = self.store.n_ff
            return self._merge(h, self._hot(h), self._cold_sparse(h.cpu(), self.cold))
        # each row computes its own choice, as in SparseFFN
        chosen, h_cpu = fires.cpu(), h.cpu()  # the layer's one synchronisation when the input is on the device
        cold = self.cold[union(chosen[:, self.cold])]
        self.last_active = int(chosen.any(0).sum())
        self.last_on_accelerator = int(chosen[:, self.hot].any(0).sum())
        hot = self._hot(h, fires[:, self.hot_there])  # queued on the device, runs while the CPU works
        return self._merge(h, hot, self._cold_sparse(h_cpu, cold, chosen[:, cold]))

    def _hot(self, h: torch.Tensor, mask: torch.Tensor | None = None, chooser: Selector | None = None,
             many: bool = False) -> torch.Tensor | None:
        if self.accelerator is None:
            return None
        mask = None if mask is None else mask.to(self.device)
        return self.accelerator.ffn(h.float().to(self.device), self.activation, mask, chooser, many)

    def _merge(self, h: torch.Tensor, hot: torch.Tensor | None, cold: torch.Tensor | None) -> torch.Tensor:
        """hot + cold + the down bias, on the device `h` came on (copying hot back waits for the
        accelerator; merging on the accelerator sends the CPU's part over)."""
        parts = [p.to(h.device) for p in (hot, cold) if p is not None]
        y = parts[0] if parts else torch.zeros(h.shape[0], self.store.dim_out, device=h.device)
        for part in parts[1:]:
            y = y.add_(part)
        return y if self.down_bias is None else y.add_(self.down_bias)

    def _cold_dense(self, h: torch.Tensor, chooser: Selector | None, keep: torch.Tensor | None) -> torch.Tensor | None:
        """Many rows: SparseFFN's dense products over the cold neurons, skipped ones zeroed."""
        if len(self.cold) == 0:
            return None
        a = self.dense_activations(h, self.cold)
        return self._dense(_skip(a, chooser, keep), self._weights(self.store.down, self.cold))

    def _cold_oracle(self, h: torch.Tensor) -> torch.Tensor | None:
        s, cold = self.store, self.cold
        if len(cold) == 0:
            self.last_active = self.n_hot
            return None
        a = neuron_activations(s, self.activation, h, cold)
        fired = self.selector.fired(a, None)
        keep = union(fired)
        self.last_active = self.n_hot + len(keep)  # the accelerator computes all its neurons
        if len(keep) == 0:
            return None
        return accumulate_rows(s, s.down, (a * fired)[:, keep], cold[keep])

    def _cold_sparse(self, h: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor | None:
        return sparse_ffn(self.store, self.activation, h, ids, keep) if len(ids) else None

    @property
    def device_nbytes(self) -> int:
        return 0 if self.accelerator is None else self.accelerator.nbytes
