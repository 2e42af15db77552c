"""Input-sparse linears on channel runs (TEAL-style activation sparsity).

Per row of x, an input channel i with |x_i| <= thresholds[i] is skipped, and its weights are never
read. The file keeps its rows; at load the native executor `SparseInputProjection`
(powerinfer/ops/csrc/sparse_input.h) regroups them into channel runs: per
block of 32 inputs the block's scales for every output, then each channel's weights for every output,
contiguous. The matrices of one projection (q, k and v; gate and up) go side by side along the
outputs, so that a run is long enough that skipping it saves memory traffic; matrices of different
forms (a Q4_K_M file's Q4_K q and k, its Q6_K v) go in parts that share the selection. Q4_1, Q4_K,
Q6_K and Q8_0 rows keep their bits; Q4_0's scales become a signed byte on a float16 step per 256
inputs (the scales are read whatever is skipped: bytes read faster), the one rounding the runs add
(docs/sparsity.md gives its cost); a linear of another type stays by rows (RUN_TYPES).

Up to `SPARSE_MAX_ROWS` rows read only their active channels' runs (in groups of up to four rows,
each run of the group's union read once; the kernels round x to int8 per block of 32 inputs, as the
dense row kernels do on AVX2). More rows (prefill) read all the runs, each row's skipped channels set
to 0: the runs are repacked a few outputs at a time into the dense row kernels' layout, and those
kernels multiply every row (the same result, to rounding). `sparse_reference` is the plain-torch
reference, used where the native module is absent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.huge_pages import hugepage_buffer
from powerinfer.ops.linear import Linear, mapped_tensor, slice_bounds
from powerinfer.ops.quant import T, dequantize_rows
from powerinfer.sparse.select import kept

# Calls with more rows than this take the prefill path: every channel through the dense kernels (a
# union of many rows' channels is most of them; sparse_input.cpp gives the measurements).
SPARSE_MAX_ROWS = 32

# The row types that channel runs take, in any mix (sparse_input.h: their forms).
RUN_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q6_K})


def runs_take(types: Sequence[T]) -> bool:
    """Whether matrices of these types, side by side, have channel runs."""
    return all(t in RUN_TYPES for t in types)


@dataclass(frozen=True)
class RowMatrix:
    """One weight [out, in] as its file stores it: raw GGML rows uint8 [out, bytes per row]."""

    rows: torch.Tensor
    ggml_type: T
    in_features: int

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    def dequantized(self) -> torch.Tensor:
        """W as float32 [out, in]."""
        return dequantize_rows(self.rows, self.ggml_type, self.in_features)


def _row_slices(m: RowMatrix) -> list[RowMatrix]:
    """`m` as consecutive slices of rows, as QuantLinear's repacking slices (side by side they are `m`)."""
    return [RowMatrix(m.rows[a:b], m.ggml_type, m.in_features) for a, b in slice_bounds(m.out_features, m.rows.shape[1])]


def from_gguf(tensor: GGUFTensor) -> RowMatrix:
    """A weight as a GGUF file stores it, left in the mapping."""
    if tensor.ggml_type not in RUN_TYPES or len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name}: channel runs take a matrix of {', '.join(sorted(t.name for t in RUN_TYPES))}, "
                         f"not {tensor.ggml_type.name}")
    return RowMatrix(mapped_tensor(tensor.rows_as_bytes()), tensor.ggml_type, tensor.shape[1])


def sparse_reference(matrices: Sequence[RowMatrix], thresholds: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What the native projection computes, in plain torch: the channels above threshold of each row
    times the dequantized weights, float32 (the file's own Q4_0 scales: without the runs' rounding)."""
    x = x.float()
    x = torch.where(kept(x, thresholds), x, torch.zeros_like(x))
    return x @ torch.cat([m.dequantized() for m in matrices], dim=0).T


class ColumnLinear(Linear):
    """y = x @ W.T on channel runs, skipping each row's inputs at or below their thresholds.
    `projection` is the native SparseInputProjection (what the C++ decode step calls), None
    without the native module. `release_pages`, given, drops the file's mapped pages once the runs
    are built (they are then the only copy)."""

    def __init__(self, matrices: Sequence[RowMatrix], thresholds: torch.Tensor,
                 release_pages: Callable[[], None] | None = None):
        self.matrices = list(matrices)
        self.in_features = self.matrices[0].in_features
        self.out_features = sum(m.out_features for m in self.matrices)
        if any(m.in_features != self.in_features for m in self.matrices):
            raise ValueError("the matrices of a sparse linear must share their inputs")
        if not runs_take([m.ggml_type for m in self.matrices]):
            raise ValueError(f"no channel-run form for {', '.join(m.ggml_type.name for m in self.matrices)} side by side")
        if thresholds.shape != (self.in_features,):
            raise ValueError(f"one threshold per input channel ({self.in_features}), not {tuple(thresholds.shape)}")
        self.thresholds = thresholds.float().contiguous()
        ops = native.load()
        self.projection = None
        self._bytes = sum(m.rows.numel() for m in self.matrices)
        if ops is not None:
            # with release_pages, large matrices go in slices of rows, the file's pages dropped after each
            # (a 262k-row head would otherwise hold both copies whole: +120 MiB peak on Gemma 3 270M)
            parts = [p for m in self.matrices for p in _row_slices(m)] if release_pages else self.matrices
            types = [int(m.ggml_type) for m in parts]
            self._bytes = ops.channel_run_bytes(types, [m.out_features for m in parts], self.in_features)
            destination, self._region = hugepage_buffer(self._bytes)
            self.projection = ops.SparseInputProjection([m.rows for m in parts], types, self.in_features,
                                                        self.thresholds, SPARSE_MAX_ROWS, destination, release_pages)
            self.matrices = []  # the runs are the weights now

    def to(self, device: torch.device) -> ColumnLinear:
        if torch.device(device).type != "cpu":
            raise ValueError("channel runs run on the CPU only")
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
    def last_bytes_read(self) -> int | None:
        """Bytes of the runs the last call read: its active blocks' scales and its active channels'
        runs (None without the native module)."""
        return None if self.projection is None else self.projection.last_bytes_read

    @property
    def nbytes(self) -> int:
        return self._bytes


def column_linear(matrices: Sequence[RowMatrix | GGUFTensor], thresholds: torch.Tensor,
                  release_pages: Callable[[], None] | None = None) -> ColumnLinear:
    """A ColumnLinear over weights (GGUF tensors or RowMatrix), side by side along the outputs."""
    return ColumnLinear([m if isinstance(m, RowMatrix) else from_gguf(m) for m in matrices], thresholds, release_pages)
