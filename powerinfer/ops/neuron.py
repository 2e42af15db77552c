"""FFN weights stored per neuron, and the neuron-aware sparse operators over them.

`NeuronStore` keeps one contiguous record per FFN neuron holding its gate row, up row and
ffn_down_t row (the down projection's column), each in its GGUF block encoding: computing an
active neuron then reads one stretch of memory, which is what makes skipping neurons pay on a CPU
(scattered rows are bound by memory latency, not bandwidth). The operators are C++ (ops/csrc);
each has a plain-torch reference here that computes the same arithmetic, for tests and for
machines where the native build is unavailable.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass


import torch
from gguf import GGMLQuantizationType, quants

from powerinfer.config import FFNActivation
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.activation import activate
from powerinfer.ops.linear import mapped_tensor
from powerinfer.ops.quant import FLOAT_TYPES, QK, T, dequantize_rows

RECORD_ALIGN = 64  # records start on cache lines
KERNEL_ACTIVATIONS = {FFNActivation.RELU_GATED: 0, FFNActivation.RELU: 0, FFNActivation.SILU_GATED: 1,
                      FFNActivation.GELU_GATED: 2, FFNActivation.GELU: 2, FFNActivation.DRELU: 3}


@dataclass(frozen=True)
class Section:
    """Where one weight row lives inside a neuron record, and how it is encoded."""

    q_off: int
    d_off: int  # float16 block scales (bits 4 and 8)
    m_off: int  # float16 block offsets (bits 4 with offsets, as Q4_1), else -1
    bits: int  # 4: Q4_0/Q4_1 values, 8: Q8_0 values, 32: float32
    n_values: int

    def as_list(self) -> list[int]:
        return [self.q_off, self.d_off, self.m_off, self.bits, self.n_values, 0]

    @property
    def n_blocks(self) -> int:
        return self.n_values // QK


def _encoded_rows(rows: GGUFTensor | torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """(bits, [values, scales(, offsets)]) as uint8 [n, bytes] blocks of a row matrix.

    Q4_0, Q4_1 and Q8_0 keep the file's values; float rows stay float32; other types are
    re-encoded as Q8_0 (whose error is far below theirs).
    """
    if isinstance(rows, torch.Tensor) or rows.ggml_type in FLOAT_TYPES:
        values = rows.float() if isinstance(rows, torch.Tensor) else mapped_tensor(rows.data).reshape(rows.shape).float()
        return 32, [values.contiguous().view(torch.uint8)]
    raw = mapped_tensor(rows.rows_as_bytes())
    n = raw.shape[0]
    if rows.ggml_type in (T.Q4_0, T.Q4_1):
        header = 2 if rows.ggml_type == T.Q4_0 else 4
        blocks = raw.reshape(n, -1, header + QK // 2)
        parts = [blocks[..., header:].reshape(n, -1), blocks[..., 0:2].reshape(n, -1)]
        if rows.ggml_type == T.Q4_1:
            parts.append(blocks[..., 2:4].reshape(n, -1))
        return 4, parts
    if rows.ggml_type != T.Q8_0:
        floats = dequantize_rows(raw, rows.ggml_type, rows.shape[1]).numpy()
        raw = torch.from_numpy(quants.quantize(floats, GGMLQuantizationType.Q8_0))
    blocks = raw.reshape(n, -1, 2 + QK)
    return 8, [blocks[..., 2:].reshape(n, -1), blocks[..., 0:2].reshape(n, -1)]


def hugepage_buffer(nbytes: int) -> tuple[torch.Tensor, mmap.mmap]:
    """A zeroed uint8 tensor in anonymous memory backed by transparent huge pages where the kernel
    allows: gathering scattered neuron records then costs far fewer TLB misses."""
    size = max(1, -(-nbytes // (2 << 20))) * (2 << 20)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes), region


class NeuronStore:
    """One record per FFN neuron: [gate row | up row | down_t row], each section in its encoding;
    and the FFN's biases (OPT), float32: `up_bias` per neuron, `down_bias` added once per output."""

    def __init__(self, gate: GGUFTensor | torch.Tensor | None, up: GGUFTensor | torch.Tensor,
                 down_t: GGUFTensor | torch.Tensor, up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None):
        encoded = [None if gate is None else _encoded_rows(gate), _encoded_rows(up), _encoded_rows(down_t)]
        n_ff = up.shape[0]
        sections: list[Section | None] = []
        offset = 0
        for source, enc in zip((gate, up, down_t), encoded):
            if enc is None:
                sections.append(None)
                continue
            bits, parts = enc
            offsets = []
            for part in parts:
                offsets.append(offset)
                offset += part.shape[1]
            sections.append(Section(offsets[0], offsets[1] if len(offsets) > 1 else -1,
                                    offsets[2] if len(offsets) > 2 else -1, bits, source.shape[1]))
        self.record_bytes = -(-offset // RECORD_ALIGN) * RECORD_ALIGN
        flat, self._region = hugepage_buffer(n_ff * self.record_bytes)
        self.records = flat.view(n_ff, self.record_bytes)
        for section, enc in zip(sections, encoded):
            if enc is None:
                continue
            for part, start in zip(enc[1], (section.q_off, section.d_off, section.m_off)):
                self.records[:, start : start + part.shape[1]] = part
        self.gate, self.up, self.down = sections
        self.n_ff, self.dim_in, self.dim_out = n_ff, sections[1].n_values, sections[2].n_values
        self.up_bias = None if up_bias is None else up_bias.float()
        self.down_bias = None if down_bias is None else down_bias.float()

    @property
    def nbytes(self) -> int:
        return self.records.nbytes

    def add_up_bias(self, up: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The up products [m, len(idx)] of neurons `idx` (all when None) plus their biases."""
        if self.up_bias is None:
            return up
        return up.float() + (self.up_bias if idx is None else self.up_bias[idx])

    def add_down_bias(self, y: torch.Tensor) -> torch.Tensor:
        """The FFN output from its neurons' sum y (updated in place)."""
        return y if self.down_bias is None else y.add_(self.down_bias)

    def weights(self, section: Section, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Exact float32 weights of `section` for neurons `idx` (all when None): [n, n_values]."""
        return dequantize_records(self.records if idx is None else self.records[idx], section)


def _f16_section(rows: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    return rows[:, offset : offset + 2 * n].contiguous().view(torch.float16).float()


def q4_section(rows: torch.Tensor, section: Section) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit section of neuron records [n, record_bytes] as (nibbles uint8 [n, K], scale and
    offset float32 [n, K/32]) with weight = scale * nibble + offset."""
    n = rows.shape[0]
    packed = rows[:, section.q_off : section.q_off + section.n_values // 2].view(n, -1, QK // 2)
    nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=-1).view(n, -1)
    d = _f16_section(rows, section.d_off, section.n_blocks)
    m = _f16_section(rows, section.m_off, section.n_blocks) if section.m_off >= 0 else -8.0 * d
    return nibbles, d, m


def q8_section(rows: torch.Tensor, section: Section) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit section of neuron records as (int8 values [n, K], scales float32 [n, K/32])."""
    values = rows[:, section.q_off : section.q_off + section.n_values].contiguous().view(torch.int8)
    return values, _f16_section(rows, section.d_off, section.n_blocks)


def dequantize_records(rows: torch.Tensor, section: Section) -> torch.Tensor:
    """Exact float32 weights of `section` from neuron records [n, record_bytes] on any device."""
    n = rows.shape[0]
    if section.bits == 32:
        return rows[:, section.q_off : section.q_off + 4 * section.n_values].contiguous().view(torch.float32)
    if section.bits == 8:
        q, d = q8_section(rows, section)
        return (q.float().view(n, -1, QK) * d[..., None]).view(n, -1)
    nibbles, d, m = q4_section(rows, section)
    return (nibbles.float().view(n, -1, QK) * d[..., None] + m[..., None]).view(n, -1)


# ---------------------------------------------------------------- operators and their references

def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 values as float [M, K/32, 32], scales [M, K/32], exact block sums [M, K/32]),
    the per-block int8 rounding the native dot products apply."""
    blocks = x.float().view(x.shape[0], -1, QK)
    scale = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None])
    return q, scale, blocks.sum(-1)


def gather_matvec_reference(store: NeuronStore, section: Section, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return matvec_records(store.records[idx], section, x)


def matvec_records(rows: torch.Tensor, section: Section, x: torch.Tensor) -> torch.Tensor:
    """y[m, j] = W_j . x[m] for neuron records [n, record_bytes] on any device, in the native
    kernels' arithmetic (x rounded to int8 per block for 4/8-bit rows, exact block sums)."""
    w = dequantize_records(rows, section)
    if section.bits == 32:
        return x.float() @ w.T
    n = w.shape[0]
    q, scale, sums = quantize_activations(x)
    if section.bits == 8:
        m = torch.zeros(n, section.n_blocks, device=rows.device)
    else:
        m = q4_section(rows, section)[2]
    scaled = (w.view(n, -1, QK) - m[..., None])  # d * q
    dots = torch.einsum("nbk,mbk->mnb", scaled, q * scale[..., None])
    return dots.sum(-1) + sums @ m.T


def accumulate_rows_reference(store: NeuronStore, section: Section, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return a.float() @ store.weights(section, idx)


def activate_reference(activation: FFNActivation, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
    return activate(up if gate is None else torch.cat([gate, up], dim=-1), activation)


def _sparse_ffn_steps(store: NeuronStore, activation: FFNActivation, x: torch.Tensor, idx: torch.Tensor,
                      matvec, accumulate, keep: torch.Tensor | None = None) -> torch.Tensor:
    gate = None if store.gate is None else matvec(store, store.gate, x, idx)
    up = store.add_up_bias(matvec(store, store.up, x, idx), idx)
    a = activate_reference(activation, gate, up)
    return accumulate(store, store.down, a if keep is None else a * keep, idx)


def sparse_ffn_reference(store: NeuronStore, activation: FFNActivation, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _sparse_ffn_steps(store, activation, x, idx, gather_matvec_reference, accumulate_rows_reference)


def gather_matvec(store: NeuronStore, section: Section, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """y[m, j] = W[idx[j]] . x[m] for the rows of `section` of the given neurons."""
    ops = native.load()
    if ops is None:
        return gather_matvec_reference(store, section, x, idx)
    return ops.gather_matvec(store.records, section.as_list(), x.float().contiguous(), idx.contiguous())


def accumulate_rows(store: NeuronStore, section: Section, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """y[m] = sum_j a[m, j] * W[idx[j]] over the rows of `section` of the given neurons."""
    ops = native.load()
    if ops is None:
        return accumulate_rows_reference(store, section, a, idx)
    return ops.accumulate_rows(store.records, section.as_list(), a.float().contiguous(), idx.contiguous())


def sparse_ffn(store: NeuronStore, activation: FFNActivation, x: torch.Tensor, idx: torch.Tensor,
               keep: torch.Tensor | None = None) -> torch.Tensor:
    """The FFN output computed from the neurons `idx` only (sorted int64), fused per neuron; with
    `keep` [rows, len(idx)] bool, each row of x uses only its own neurons among them. The down bias
    is left to the caller: a hybrid FFN adds up several such parts."""
    ops = native.load()
    if keep is not None and x.shape[0] > 1:  # rows choose differently: activations masked between the steps
        return _sparse_ffn_steps(store, activation, x, idx, gather_matvec, accumulate_rows, keep)
    if ops is None:
        return sparse_ffn_reference(store, activation, x, idx)
    if store.up_bias is not None:  # the fused kernel knows no bias: its steps, the bias added between
        return _sparse_ffn_steps(store, activation, x, idx, gather_matvec, accumulate_rows)
    gate = [] if store.gate is None else store.gate.as_list()
    return ops.sparse_ffn(store.records, gate, store.up.as_list(), store.down.as_list(),
                          KERNEL_ACTIVATIONS[activation], x.float().contiguous(), idx.contiguous())
