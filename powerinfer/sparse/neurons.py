"""FFN weights stored per neuron, and the neuron-aware sparse operators over them.

`NeuronStore` keeps one contiguous record per FFN neuron holding its gate row, up row and
ffn_down_t row (the down projection's column), each in its GGUF block encoding (Q4_0, Q4_1 and
Q8_0 with their scales split from their values; Q5_0, Q5_1 and the K-quants as the file's own
blocks; floats as float32): computing an active neuron then reads one stretch of memory, which is what makes skipping neurons pay on a CPU
(scattered rows are bound by memory latency, not bandwidth). The operators are C++ (ops/csrc);
each has a plain-torch reference here that computes the same arithmetic, for tests and for
machines where the native build is unavailable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from powerinfer.config import FFNActivation
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.huge_pages import hugepage_buffer
from powerinfer.ops.linear import mapped_tensor
from powerinfer.ops.quant import BLOCK_TYPES, FLOAT_TYPES, QK, T, dequantize_rows

RECORD_ALIGN = 64  # records start on cache lines
SPLIT_TYPES = {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}  # kept as values + float16 scales (bits per value)
RAW = 0  # Section.bits of rows kept as the file's blocks
# Where the integers of a block type with a minimum lie (byte ranges within a block): a block with
# them zeroed dequantizes to its minimum part (dmin * mn per sub-block), which the kernels multiply
# by exact sums of x.
_QUANT_BYTES = {T.Q5_1: (4, 24), T.Q2_K: (16, 80), T.Q4_K: (16, 144), T.Q5_K: (16, 176)}
MIN_GROUP = 16  # the finest sub-block of any block type: minimum parts are constant over it


@dataclass(frozen=True)
class Section:
    """Where one weight row lives inside a neuron record, and how it is encoded."""

    q_off: int
    d_off: int  # float16 block scales (bits 4 and 8)
    m_off: int  # float16 block offsets (bits 4 with offsets, as Q4_1), else -1
    bits: int  # 4: Q4_0/Q4_1 values, 8: Q8_0 values, 32: float32, RAW: blocks of ggml_type
    n_values: int
    ggml_type: int = -1  # RAW sections

    def as_list(self) -> list[int]:
        return [self.q_off, self.d_off, self.m_off, self.bits, self.n_values, self.ggml_type]

    @property
    def n_blocks(self) -> int:
        return self.n_values // QK


def record_row_bytes(ggml_type: T, n_values: int) -> int:
    """Bytes of one row of `ggml_type` in a neuron record (`_encoded_rows`): block types as the
    file's blocks (Q4_0, Q4_1 and Q8_0 split into the same bytes), floats as float32, any other type
    re-encoded as Q8_0."""
    block, size = GGML_QUANT_SIZES[_record_type(ggml_type)]
    return n_values // block * size


def _record_type(ggml_type: T) -> T:
    return T.F32 if ggml_type in FLOAT_TYPES else ggml_type if ggml_type in BLOCK_TYPES else T.Q8_0


def _encoded_rows(rows: GGUFTensor | torch.Tensor) -> tuple[int, list[torch.Tensor], int]:
    """(bits, [values, scales(, offsets)], GGML type of RAW rows) as uint8 [n, bytes] parts of a row matrix."""
    if isinstance(rows, torch.Tensor) or rows.ggml_type in FLOAT_TYPES:
        values = rows.float() if isinstance(rows, torch.Tensor) else mapped_tensor(rows.data).reshape(rows.shape).float()
        return 32, [values.contiguous().view(torch.uint8)], -1
    raw = mapped_tensor(rows.rows_as_bytes())
    n = raw.shape[0]
    record_type = _record_type(rows.ggml_type)
    if record_type != rows.ggml_type:
        floats = dequantize_rows(raw, rows.ggml_type, rows.shape[1]).numpy()
        raw = torch.from_numpy(quants.quantize(floats, GGMLQuantizationType.Q8_0))
    if record_type not in SPLIT_TYPES:
        return RAW, [raw], int(record_type)
    if record_type == T.Q8_0:
        blocks = raw.reshape(n, -1, 2 + QK)
        return 8, [blocks[..., 2:].reshape(n, -1), blocks[..., 0:2].reshape(n, -1)], -1
    header = 2 if record_type == T.Q4_0 else 4
    blocks = raw.reshape(n, -1, header + QK // 2)
    parts = [blocks[..., header:].reshape(n, -1), blocks[..., 0:2].reshape(n, -1)]
    if record_type == T.Q4_1:
        parts.append(blocks[..., 2:4].reshape(n, -1))
    return 4, parts, -1


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
            bits, parts, ggml_type = enc
            offsets = []
            for part in parts:
                offsets.append(offset)
                offset += part.shape[1]
            sections.append(Section(offsets[0], offsets[1] if len(offsets) > 1 else -1,
                                    offsets[2] if len(offsets) > 2 else -1, bits, source.shape[1], ggml_type))
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


def _raw_blocks(rows: torch.Tensor, section: Section) -> np.ndarray:
    """A RAW section of neuron records as the file's bytes, uint8 [n, bytes] (on the CPU)."""
    block, size = GGML_QUANT_SIZES[T(section.ggml_type)]
    return rows[:, section.q_off : section.q_off + section.n_values // block * size].cpu().numpy()


def _dequantized_raw(raw: np.ndarray, section: Section, device: torch.device) -> torch.Tensor:
    flat = quants.dequantize(raw, T(section.ggml_type)).astype(np.float32, copy=False)
    return torch.from_numpy(flat).reshape(raw.shape[0], section.n_values).to(device)


def dequantize_records(rows: torch.Tensor, section: Section) -> torch.Tensor:
    """Exact float32 weights of `section` from neuron records [n, record_bytes] on any device."""
    n = rows.shape[0]
    if section.bits == 32:
        return rows[:, section.q_off : section.q_off + 4 * section.n_values].contiguous().view(torch.float32)
    if section.bits == RAW:
        return _dequantized_raw(_raw_blocks(rows, section), section, rows.device)
    if section.bits == 8:
        q, d = q8_section(rows, section)
        return (q.float().view(n, -1, QK) * d[..., None]).view(n, -1)
    nibbles, d, m = q4_section(rows, section)
    return (nibbles.float().view(n, -1, QK) * d[..., None] + m[..., None]).view(n, -1)


def offset_parts(rows: torch.Tensor, section: Section) -> torch.Tensor:
    """The part of each weight the kernels multiply by an exact sum of x rather than by x rounded
    to int8: a 4-bit block's offset, a block type's minimum (dmin * mn); constant over each group of
    16 inputs, float32 [n, K / 16]."""
    n = rows.shape[0]
    if section.bits == 4:
        return q4_section(rows, section)[2].repeat_interleave(QK // MIN_GROUP, dim=1)
    if section.bits != RAW or T(section.ggml_type) not in _QUANT_BYTES:
        return torch.zeros(n, section.n_values // MIN_GROUP, device=rows.device)
    block, size = GGML_QUANT_SIZES[T(section.ggml_type)]
    start, end = _QUANT_BYTES[T(section.ggml_type)]
    raw = _raw_blocks(rows, section).reshape(n, -1, size).copy()
    raw[..., start:end] = 0
    return _dequantized_raw(raw.reshape(n, -1), section, rows.device)[:, ::MIN_GROUP]


# ---------------------------------------------------------------- operators and their references

def activate(up_out: torch.Tensor, activation: FFNActivation) -> torch.Tensor:
    """Neuron activations from the up-projection output ([gate, up] halves when gated): every
    FFNActivation, as the C++ kernels compute them (csrc/common.h numbers the same ones)."""
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


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 values as float [M, K/32, 32], scales [M, K/32], exact sums of each 16
    inputs [M, K/16]), the per-block int8 rounding the native dot products apply."""
    blocks = x.float().view(x.shape[0], -1, QK)
    scale = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None])
    return q, scale, x.float().view(x.shape[0], -1, MIN_GROUP).sum(-1)


def gather_matvec_reference(store: NeuronStore, section: Section, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return matvec_records(store.records[idx], section, x)


def matvec_records(rows: torch.Tensor, section: Section, x: torch.Tensor) -> torch.Tensor:
    """y[m, j] = W_j . x[m] for neuron records [n, record_bytes] on any device, in the native
    kernels' arithmetic (x rounded to int8 per block of 32 for quantized rows, exact sums of x for
    offsets and minimums)."""
    w = dequantize_records(rows, section)
    if section.bits == 32:
        return x.float() @ w.T
    n = w.shape[0]
    q, scale, sums = quantize_activations(x)
    offsets = offset_parts(rows, section)
    scaled = (w.view(n, -1, MIN_GROUP) - offsets[..., None]).view(n, -1, QK)  # d sc (q - offset)
    dots = torch.einsum("nbk,mbk->mnb", scaled, q * scale[..., None])
    return dots.sum(-1) + sums @ offsets.T


def accumulate_rows_reference(store: NeuronStore, section: Section, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return a.float() @ store.weights(section, idx)


def neuron_activations(store: NeuronStore, activation: FFNActivation, x: torch.Tensor, idx: torch.Tensor,
                       matvec=None) -> torch.Tensor:
    """The activations [m, len(idx)] of neurons `idx` for x [m, d], their gate and up rows through
    `matvec` (default: the native row-gather, `gather_matvec`)."""
    matvec = gather_matvec if matvec is None else matvec
    gate = None if store.gate is None else matvec(store, store.gate, x, idx)
    up = store.add_up_bias(matvec(store, store.up, x, idx), idx)
    return activate(up if gate is None else torch.cat([gate, up], dim=-1), activation)


def _sparse_ffn_steps(store: NeuronStore, activation: FFNActivation, x: torch.Tensor, idx: torch.Tensor,
                      matvec, accumulate, keep: torch.Tensor | None = None) -> torch.Tensor:
    a = neuron_activations(store, activation, x, idx, matvec)
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
                          native.activation(activation), x.float().contiguous(), idx.contiguous())
