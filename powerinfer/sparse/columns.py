"""Input-sparse linears on a column layout (TEAL-style activation sparsity).

Per row of x, an input channel i with |x_i| <= thresholds[i] is skipped, and its weights are never
read: W [out, in] is stored by columns, as the raw GGML rows of the transposed weight W.T (row i of
that tensor is column i of W, in a block type: Q4_0, Q4_1, Q8_0, or Q4_K / Q6_K where the outputs
are whole super-blocks of 256). A fused projection (q, k and v) keeps several transposed matrices
side by side along the outputs: channel i's record holds its column of each.

The native executor is `SparseInputProjection` (powerinfer/ops/csrc/sparse_input.h): up to
`SPARSE_MAX_ROWS` rows read only their active channels' columns, more rows (prefill) read all of
them, each row's skipped channels set to 0 (the same result: logits do not depend on batching). On AVX2 (and AVX-512) CPUs it rounds Q4_0 and Q4_1 coefficients x_i d_i to int8 per block of
32 outputs and batch of channels, as the dense AVX2 kernel rounds x to int8 per 32 inputs; other
types, and the scalar path, multiply float32 x by the dequantized weights. `sparse_reference` is
the plain-torch reference, used where the native module is absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, quants

from powerinfer.convert.kquants import K_QUANT_TYPES, quantize_k
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.linear import Linear, mapped_tensor
from powerinfer.ops.quant import BLOCK_TYPES, T, dequantize_rows
from powerinfer.sparse.neurons import hugepage_buffer
from powerinfer.sparse.select import kept

# Calls with more rows than this read every column (prefill): a union of many rows' channels
# is most of them, and a matrix product of dequantized tiles is then faster than column sums
# (measured, 4096 x 4096 Q4_0, one thread, AVX2: 9 rows 5.4 ms sparse vs 13.3 ms tiles, 64 rows
# 35 vs 30 ms).
SPARSE_MAX_ROWS = 32


@dataclass(frozen=True)
class ColumnMatrix:
    """One transposed weight in GGML blocks: rows uint8 [in, bytes], row i holding column i of W."""

    rows: torch.Tensor
    ggml_type: T
    out_features: int

    @property
    def in_features(self) -> int:
        return self.rows.shape[0]

    def dequantized(self) -> torch.Tensor:
        """W.T as float32 [in, out]."""
        return dequantize_rows(self.rows, self.ggml_type, self.out_features)


def from_gguf(tensor: GGUFTensor) -> ColumnMatrix:
    """A transposed weight as a GGUF file stores it (torch shape [in, out]), left in the mapping."""
    if tensor.ggml_type not in BLOCK_TYPES or len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: a column layout takes a matrix in a GGML block type, not {tensor.ggml_type.name}")
    return ColumnMatrix(mapped_tensor(tensor.rows_as_bytes()), tensor.ggml_type, tensor.shape[1])


def transpose_quantize(weight: torch.Tensor, ggml_type: T) -> ColumnMatrix:
    """The columns of a float weight [out, in] quantized to `ggml_type`: the gguf package's encoder,
    ours for the K-quants (which the gguf package does not encode)."""
    block = GGML_QUANT_SIZES[ggml_type][0]
    out_features = weight.shape[0]
    if ggml_type not in BLOCK_TYPES or out_features % block:
        raise ValueError(f"{out_features} outputs do not split into blocks of {ggml_type.name} ({block} values)")
    columns = weight.detach().T.float().contiguous().numpy()
    raw = quantize_k(columns, ggml_type) if ggml_type in K_QUANT_TYPES else quants.quantize(columns, ggml_type)
    return ColumnMatrix(torch.from_numpy(raw), ggml_type, out_features)


def sparse_reference(matrices: Sequence[ColumnMatrix], thresholds: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the native projection computes, in plain torch: the channels above threshold of each row
    times the dequantized columns, float32."""
    x = x.float()
    x = torch.where(kept(x, thresholds), x, torch.zeros_like(x))
    return x @ torch.cat([m.dequantized() for m in matrices], dim=1)


class ColumnLinear(Linear):
    """y = x @ W.T on column records, skipping each row's inputs at or below their thresholds.
    `projection` is the native SparseInputProjection (what the C++ decode step calls), None
    without the native module."""

    def __init__(self, matrices: Sequence[ColumnMatrix], thresholds: torch.Tensor):
        self.matrices = list(matrices)
        self.in_features = self.matrices[0].in_features
        self.out_features = sum(m.out_features for m in self.matrices)
        if any(m.in_features != self.in_features for m in self.matrices):
            raise ValueError("the matrices of a column layout must share their inputs")
        if thresholds.shape != (self.in_features,):
            raise ValueError(f"one threshold per input channel ({self.in_features}), not {tuple(thresholds.shape)}")
        self.thresholds = thresholds.float().contiguous()
        ops = native.load()
        self.projection = None
        if ops is not None:
            # one record per channel: its column of every matrix (a copy only for fused matrices)
            records = torch.cat([m.rows for m in self.matrices], dim=1) if len(self.matrices) > 1 else self.matrices[0].rows
            destination, self._region = hugepage_buffer(records.numel())
            self.projection = ops.SparseInputProjection(records.contiguous(), [int(m.ggml_type) for m in self.matrices],
                                                        [m.out_features for m in self.matrices], self.thresholds,
                                                        SPARSE_MAX_ROWS, destination.view(records.shape))

    def to(self, device: torch.device) -> ColumnLinear:
        if torch.device(device).type != "cpu":
            raise ValueError("column layouts run on the CPU only")
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.projection is not None:
            return self.projection(x)
        return sparse_reference(self.matrices, self.thresholds, x)

    @property
    def native(self):
        return self.projection

    @property
    def last_selected(self) -> int | None:
        """(row, channel) pairs the last call computed (None without the native module)."""
        return None if self.projection is None else self.projection.last_selected

    @property
    def nbytes(self) -> int:
        return sum(m.rows.numel() for m in self.matrices)


def column_linear(matrices: Sequence[ColumnMatrix | GGUFTensor], thresholds: torch.Tensor) -> ColumnLinear:
    """A ColumnLinear over transposed weights (GGUF tensors or ColumnMatrix), side by side along the outputs."""
    return ColumnLinear([m if isinstance(m, ColumnMatrix) else from_gguf(m) for m in matrices], thresholds)
