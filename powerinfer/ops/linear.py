"""Linear layers over GGUF weights, kept compact.

Every GGML block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K) runs on our native kernel
(`QuantLinear`; powerinfer/ops/csrc/quant_matmul.h describes its layout and arithmetic): the weights
stay in their blocks, repacked 16 outputs at a time at about the file's size, and the quantized
integers are exact in bfloat16, so on AVX-512 each instruction does 32 exact products of bfloat16
activations and weights, summed in float32 and scaled per (sub-)block by the file's own scales. An
AVX2 path computes the same sums with float32 multiply-adds (measured faster than torch's int4
kernel restricted to AVX2), a plain C++ path anywhere else (there Q4_0, Q4_1 and Q8_0 go to
torch's int4 kernel, which is faster than plain C++).

Without the native module, Q4_0 and Q4_1 map exactly onto torch's int4 CPU kernel (`Int4Linear`,
`_weight_int4pack_mm_for_cpu`: 4-bit values, one bfloat16 scale and offset per 32 inputs, bfloat16
activations and outputs); Q8_0 maps onto it too, each int8 value split into a high and a low nibble
(q = 16*hi + lo), two int4 matrices side by side that read the input twice; the other block types
are expanded to bfloat16. Float weights use torch's dense kernels.

Weights placed on an accelerator go to torch's int4 GPU kernel (`_weight_int4pack_mm`,
"tinygemm"), which takes the same values, scales and offsets in its own packed layout.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import cache, cached_property, reduce
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.huge_pages import hugepage_buffer
from powerinfer.ops.quant import (
    BLOCK_TYPES,
    FLOAT_TYPES,
    QK,
    T,
    dequantize_rows,
    split_q4_blocks,
    split_q8_blocks,
)

CPU = torch.device("cpu")
INT4_KERNELS = {"cpu": torch.ops.aten._weight_int4pack_mm_for_cpu, "cuda": torch.ops.aten._weight_int4pack_mm}
PACK_BLOCK_N = 64  # rows per block in the AVX-512 packed layout; we pad outputs to a multiple


def mapped_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a read-only memory-mapped array (we never write through it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.from_numpy(array)


def dequantized(tensor: GGUFTensor) -> torch.Tensor:
    """A 2-D tensor of any type as float32 [rows, cols] (exact: the file's values)."""
    return dequantize_rows(mapped_tensor(tensor.rows_as_bytes()), tensor.ggml_type, tensor.shape[1])


def float_vector(tensor: GGUFTensor) -> torch.Tensor:
    """A 1-D tensor of a float type (norm weights, biases) as float32."""
    return mapped_tensor(tensor.data).float()


class Linear(ABC):
    """y = x @ W.T for x of shape [tokens, in_features]; y may come back in a low-precision dtype."""

    in_features: int
    out_features: int
    # The file tensors a layer was built from (`build_linear`): moving it to another device rebuilds
    # it there in that device's layout, from the file rather than from this layout.
    sources: tuple[GGUFTensor, ...] = ()

    def to(self, device: torch.device) -> Linear:
        """The same layer on `device`, as `build_linear` lays it out for a device given."""
        return build_linear(self.sources, device=device)

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of weight data read per call (for bandwidth figures)."""

    @property
    def native(self):
        """The C++ projection (csrc/projection.h) that runs this layer inside the native decode
        step, or None where the layer has none (the step then falls back to Python)."""
        return None


class DenseLinear(Linear):
    """A float32, float16 or bfloat16 weight matrix."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape

    def to(self, device: torch.device) -> DenseLinear:
        return DenseLinear(self.weight.to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float16 and x.shape[0] > 1 and w.is_cpu:
            # torch's float16 CPU matmul is fast only for a single row.
            return F.linear(x.float(), w.float())
        return F.linear(x.to(w.dtype), w)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


def _pack_nibbles_reference(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.to(torch.int32), 1)


def _pack_nibbles_avx512(nibbles: torch.Tensor) -> torch.Tensor:
    # Layout of torch's AVX-512 packing: per block of 64 rows and per input k, 32 bytes whose low
    # nibbles are rows 0..31 and high nibbles rows 32..63. Built with byte ops, no int32 copy.
    n, k = nibbles.shape
    halves = nibbles.view(n // PACK_BLOCK_N, 2, PACK_BLOCK_N // 2, k)
    packed = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous()
    return packed.view(n, k // 2)


@cache
def _fast_packing_matches() -> bool:
    """Whether our byte-op packing equals torch's on this CPU (its layout depends on the ISA)."""
    probe = torch.randint(0, 16, (2 * PACK_BLOCK_N, 2 * QK), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return torch.equal(_pack_nibbles_avx512(probe), _pack_nibbles_reference(probe))


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (N a multiple of 64) -> torch's int4 packed weight."""
    return _pack_nibbles_avx512(nibbles) if _fast_packing_matches() else _pack_nibbles_reference(nibbles)


def _pair_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K/2], two per byte, the even input in the high nibble: the
    input of torch's CUDA packing."""
    return (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]


def _inner_k_tiles(k: int) -> int:
    """The CUDA layout's k-tiles per load (8 is fastest); K must be a multiple of 16 of them."""
    return next(tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0)


class Int4Linear(Linear):
    """Weights `scale * nibble + offset`, one scale and offset per 32 inputs, on torch's int4 kernel.

    `input_repeats` > 1 means the weight matrix is several int4 matrices side by side along the
    input axis that all read the same input (how Q8_0 is represented). Build with `pack_int4`.
    """

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int, input_repeats: int = 1):
        self.packed, self.scale_zero = packed, scale_zero
        self.out_features, self.input_repeats = out_features, input_repeats
        # scale_zero is [K/32, padded rows, 2] on every device (the packed layout differs)
        self.in_features = scale_zero.shape[0] * QK // input_repeats
        self._padded = scale_zero.shape[1] != out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self.input_repeats > 1:
            x = torch.cat([x] * self.input_repeats, dim=1)  # cat is 5x cheaper than repeat here
        y = INT4_KERNELS[self.packed.device.type](x, self.packed, QK, self.scale_zero)
        return y[:, : self.out_features] if self._padded else y

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes

    @cached_property
    def native(self):
        ops = native.load()
        return None if ops is None or not self.packed.is_cpu else \
            ops.Int4Projection(self.packed, self.scale_zero, self.out_features, self.input_repeats)


INT4_SCALE_DTYPE = torch.bfloat16


def int4_shapes(n_rows: int, n_cols: int, pad: bool = True) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """What `pack_int4` allocates for n_rows x n_cols weights: nibbles uint8 [padded rows, cols/2]
    (rows padded to a whole block of 64 unless not `pad`) and scale and offset [cols/32, padded
    rows, 2] (torch's CUDA packing keeps the nibbles' byte count)."""
    padded = n_rows + (-n_rows % PACK_BLOCK_N if pad else 0)
    return (padded, n_cols // 2), (n_cols // QK, padded, 2)


NibbleRows = Callable[[GGUFTensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
PACK_CHUNK_ROWS = 4096  # rows repacked at a time (a multiple of 64): bounds the temporaries


def _stacked_rows(tensors: Sequence[GGUFTensor], nibble_rows: NibbleRows, start: int, end: int):
    """Rows start..end of the tensors stacked on top of each other."""
    parts, first = [], 0
    for t in tensors:
        lo, hi = max(start, first), min(end, first + t.shape[0])
        if lo < hi:
            parts.append(nibble_rows(t, lo - first, hi - first))
        first += t.shape[0]
    return tuple(torch.cat(p) for p in zip(*parts))


def pack_int4(tensors: Sequence[GGUFTensor], nibble_rows: NibbleRows, input_repeats: int = 1,
              device: torch.device | None = None) -> Int4Linear:
    """Repack the rows of `tensors` (stacked) for torch's int4 kernel on `device` (default: the
    CPU), a chunk of rows at a time.

    `nibble_rows(tensor, start, end)` gives rows start..end as (nibbles uint8 [n, K], scale and
    offset float32 [n, K/32]) with weight = scale * nibble + offset.
    """
    cuda = device is not None and device.type == "cuda"
    n_rows = sum(t.shape[0] for t in tensors)
    n_cols = tensors[0].shape[1] * input_repeats
    packed_shape, scale_zero_shape = int4_shapes(n_rows, n_cols)
    padded_rows = packed_shape[0]
    packed = torch.empty(packed_shape, dtype=torch.uint8)
    scale_zero = torch.empty(scale_zero_shape, dtype=INT4_SCALE_DTYPE)
    for start in range(0, padded_rows, PACK_CHUNK_ROWS):
        end = min(start + PACK_CHUNK_ROWS, padded_rows)
        nibbles, scale, offset = _stacked_rows(tensors, nibble_rows, start, min(end, n_rows))
        pad = end - start - nibbles.shape[0]  # zero rows up to a whole block of 64
        if pad:
            nibbles, scale, offset = F.pad(nibbles, (0, 0, 0, pad)), F.pad(scale, (0, 0, 0, pad)), F.pad(offset, (0, 0, 0, pad))
        packed[start:end] = _pair_nibbles(nibbles) if cuda else pack_nibbles(nibbles.contiguous())
        # Both kernels compute (nibble - 8) * scale + zero.
        scale_zero[:, start:end] = torch.stack([scale, offset + 8.0 * scale], dim=-1).transpose(0, 1)
    if cuda:
        packed = torch.ops.aten._convert_weight_to_int4pack(packed.to(device), _inner_k_tiles(n_cols))
        scale_zero = scale_zero.to(device)
    return Int4Linear(packed, scale_zero, n_rows, input_repeats)


def quant_kernel():
    """Our native module (its QuantProjection runs every block type), or None without it."""
    return native.load()


class QuantLinear(Linear):
    """GGML block-type weights on our native kernel (powerinfer/ops/csrc/quant_matmul.h describes the
    layout and arithmetic): activations rounded to bfloat16, the file's scales, float32 sums and
    outputs. Each row's result depends on that row only. Build with `pack_quant`."""

    def __init__(self, projection):
        self.projection = projection  # ops.QuantProjection, also what the C++ decode step calls
        self.in_features, self.out_features = projection.in_features, projection.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x)

    @property
    def nbytes(self) -> int:
        return sum(chunks.nbytes for chunks in self.projection.chunks)

    @property
    def native(self):
        return self.projection


# A tensor larger than this is repacked in slices of rows, so that the file pages it is read from
# can be dropped as it goes (a tied 262k-token output head is ~180 MB: otherwise both copies at once).
REPACK_SLICE_BYTES = 32 << 20


def pack_quant(tensors: Sequence[GGUFTensor], release_pages: Callable[[], None] | None = None) -> QuantLinear:
    """The rows of block-type `tensors` (stacked; types may differ, as in a Q4_K_M file's fused
    projections) repacked for QuantLinear, one packed matrix per tensor, or per slice of rows of
    a large one when `release_pages` (which drops the mapped file's pages) is given."""
    ops = quant_kernel()
    parts = [part for t in tensors for part in _repack_slices(t, ops.QUANT_COLS)] if release_pages else list(tensors)
    sliced, packed = len(parts) > len(tensors), []
    for part in parts:
        raw = mapped_tensor(part.rows_as_bytes())
        # the tensor keeps its mapping (torch.frombuffer holds a reference)
        destination, _ = hugepage_buffer(ops.quant_packed_bytes(int(part.ggml_type), *raw.shape))
        packed.append(ops.quant_repack(raw, int(part.ggml_type), destination))
        if sliced:
            release_pages()
    return QuantLinear(ops.QuantProjection(packed, [int(t.ggml_type) for t in parts], [t.shape[0] for t in parts]))


def slice_bounds(n_rows: int, row_bytes: int, row_multiple: int = 1) -> list[tuple[int, int]]:
    """Row ranges [a, b) covering `n_rows` rows, each of at most about REPACK_SLICE_BYTES and a whole
    number of `row_multiple` rows (one range when the whole fits)."""
    rows = max(row_multiple, REPACK_SLICE_BYTES // row_bytes // row_multiple * row_multiple)
    return [(a, min(a + rows, n_rows)) for a in range(0, n_rows, rows)]


def _repack_slices(tensor: GGUFTensor, row_multiple: int) -> list[GGUFTensor]:
    """`tensor` as slices of at most about REPACK_SLICE_BYTES, each a whole number of packed row
    blocks (so the packed slices hold exactly the bytes of the whole tensor packed at once)."""
    n = tensor.shape[0]
    bounds = slice_bounds(n, tensor.n_bytes // n, row_multiple)
    return [tensor.rows(a, b) for a, b in bounds] if len(bounds) > 1 else [tensor]


class ConcatLinear(Linear):
    """Several linears over the same input whose outputs are concatenated (mixed weight types)."""

    def __init__(self, parts: Sequence[Linear]):
        self.parts = list(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def to(self, device: torch.device) -> ConcatLinear:
        return ConcatLinear([part.to(device) for part in self.parts])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [part(x) for part in self.parts]
        dtype = reduce(torch.promote_types, (o.dtype for o in outputs))  # any number of parts
        return torch.cat([o.to(dtype) for o in outputs], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


class BiasedLinear(Linear):
    """A linear layer plus a bias (OPT); the output is float32."""

    def __init__(self, linear: Linear, bias: torch.Tensor):
        self.linear, self.bias = linear, bias.float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.sources = linear.sources

    def to(self, device: torch.device) -> BiasedLinear:
        return BiasedLinear(self.linear.to(device), self.bias.to(device))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float().add_(self.bias)

    @property
    def nbytes(self) -> int:
        return self.linear.nbytes + self.bias.nbytes


def _q4_rows(tensor: GGUFTensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return split_q4_blocks(mapped_tensor(tensor.rows_as_bytes()[start:end]), tensor.ggml_type)


def q8_as_nibbles(values: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0 values int8 [n, K] and scales [n, K/32] as two int4 matrices side by side (nibbles
    [n, 2K], scale and offset [n, 2K/32]) whose products with the input read twice add up exactly."""
    byte = values.view(torch.uint8)
    # q = 16 * (hi - 8) + lo with hi, lo in 0..15; on the two's-complement byte, hi = (byte >> 4) ^ 8.
    nibbles = torch.cat([(byte >> 4) ^ 8, byte & 0x0F], dim=1)
    scale = torch.cat([16.0 * d, d], dim=1)
    offset = torch.cat([-128.0 * d, torch.zeros_like(d)], dim=1)
    return nibbles, scale, offset


def _q8_rows(tensor: GGUFTensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q8_as_nibbles(*split_q8_blocks(mapped_tensor(tensor.rows_as_bytes()[start:end])))


def _dense_weight(tensor: GGUFTensor) -> torch.Tensor:
    if tensor.ggml_type in FLOAT_TYPES:
        return mapped_tensor(tensor.data).reshape(tensor.shape).clone()
    return dequantized(tensor).to(_dense_dtype(tensor.ggml_type))


def build_linear(tensors: Sequence[GGUFTensor], float32: bool = False, device: torch.device | None = None,
                 release_pages: Callable[[], None] | None = None) -> Linear:
    """One linear layer from one or more GGUF weight tensors [out, in] that share their input.

    `device` None keeps the weights on the CPU with the fastest CPU kernel; a device given (an
    accelerator, or the CPU standing in for one in tests) takes torch's int4 layout there, which
    the placement cost model counts.

    `float32` dequantizes everything to float32: the exact reference mode (several times the memory).
    `release_pages` drops the mapped file's pages: given, a large tensor is repacked a slice at a time.
    """
    layer = _build_linear(tensors, float32, device, release_pages)
    layer.sources = tuple(tensors)
    return layer


Layout = Literal["float32", "quant", "int4", "dense", "concat"]


def _layout(tensors: Sequence[GGUFTensor], float32: bool, device: torch.device | None) -> Layout:
    """Which layout `build_linear` gives `tensors`: "float32", "quant" (our kernel), "int4",
    "dense" (float types as stored, other block types expanded to bfloat16) or "concat" (mixed
    types, one layer each)."""
    if float32:
        return "float32"
    types = {t.ggml_type for t in tensors}
    ops = quant_kernel()
    # On CPUs without AVX2 our kernel is plain C++, slower than torch's int4 kernel where that fits.
    if device is None and types <= BLOCK_TYPES and ops is not None and not (_int4_exact(types) and ops.detected_isa() == "scalar"):
        return "quant"
    if _int4_exact(types):
        return "int4"
    if len(types) == 1 and (types <= FLOAT_TYPES.keys() or types <= BLOCK_TYPES):
        return "dense"
    return "concat"


def _int4_exact(types: set[T]) -> bool:
    return types <= {T.Q4_0, T.Q4_1} or types == {T.Q8_0}


def _int4_input_repeats(types: set[T]) -> int:
    return 2 if types == {T.Q8_0} else 1  # Q8_0: two nibble matrices side by side


def _dense_dtype(ggml_type: T) -> torch.dtype:
    return FLOAT_TYPES.get(ggml_type, torch.bfloat16)


def _build_linear(tensors: Sequence[GGUFTensor], float32: bool, device: torch.device | None,
                  release_pages: Callable[[], None] | None) -> Linear:
    layout, types = _layout(tensors, float32, device), {t.ggml_type for t in tensors}
    if layout == "float32":
        return DenseLinear(torch.cat([dequantized(t) for t in tensors]).to(device))
    if layout == "quant":
        return pack_quant(tensors, release_pages)
    if layout == "int4":
        return pack_int4(tensors, _q8_rows if types == {T.Q8_0} else _q4_rows, _int4_input_repeats(types), device)
    if layout == "dense":
        return DenseLinear(torch.cat([_dense_weight(t) for t in tensors]).to(device))
    return ConcatLinear([build_linear([t], device=device) for t in tensors])


def device_linear_bytes(tensors: Sequence[GGUFTensor], n_rows: int | None = None) -> int:
    """Bytes of the layer `build_linear(tensors, device=...)` allocates on an accelerator, from the
    tensors' types and shapes alone (no weights read): the placement cost model's figure. `n_rows`
    counts that many rows instead of the tensors' (per-row bytes of a neuron's rows: no padding)."""
    layout, types = _layout(tensors, False, CPU), {t.ggml_type for t in tensors}
    rows, n_cols = n_rows or sum(t.shape[0] for t in tensors), tensors[0].shape[1]
    if layout == "int4":
        # n_rows given: those rows' share, not a whole block of 64
        packed, scale_zero = int4_shapes(rows, n_cols * _int4_input_repeats(types), pad=n_rows is None)
        return math.prod(packed) + math.prod(scale_zero) * INT4_SCALE_DTYPE.itemsize
    if layout == "dense":
        return rows * n_cols * _dense_dtype(tensors[0].ggml_type).itemsize
    return sum(device_linear_bytes([t]) for t in tensors)
