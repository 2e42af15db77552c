"""GGML block formats: which we keep compact, and dequantization in torch.

Q4_0, Q4_1 and Q8_0 are dequantized here with torch ops (used for embedding rows and to repack
weights for torch's int4 kernel); every other type goes through `gguf.quants`, the reference
implementation.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

T = GGMLQuantizationType

FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
# Kept in their blocks and computed on directly by the native kernels (the formats of
# ops/csrc/ggml_blocks.h). Without them, Q4_0/Q4_1/Q8_0 map exactly onto torch's int4 kernel and
# the others are expanded to bfloat16.
BLOCK_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
SUPPORTED_TYPES = frozenset(FLOAT_TYPES) | BLOCK_TYPES

QK = 32  # elements per block in Q4_0, Q4_1 and Q8_0


def _f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 stored at byte `start` of every block, as float32 [rows, n_blocks, 1]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def split_q4_blocks(raw: torch.Tensor, ggml_type: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 rows [rows, bytes] -> (nibbles uint8 [rows, cols], scale, offset [rows, cols/32]).

    Each weight is `scale * nibble + offset`; within a block, byte j holds element j in its low
    nibble and element j + 16 in its high nibble.
    """
    rows = raw.shape[0]
    header = 2 if ggml_type == T.Q4_0 else 4
    blocks = raw.reshape(rows, -1, header + QK // 2)
    scale = _f16_field(blocks, 0)
    offset = -8.0 * scale if ggml_type == T.Q4_0 else _f16_field(blocks, 2)
    packed = blocks[..., header:]
    nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    return nibbles.reshape(rows, -1), scale.squeeze(-1), offset.squeeze(-1)


def split_q8_blocks(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows [rows, bytes] -> (int8 values [rows, cols], scale float32 [rows, cols/32])."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 2 + QK)
    scale = _f16_field(blocks, 0).squeeze(-1)
    values = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, -1)
    return values, scale


def dequantize_rows(raw: torch.Tensor, ggml_type: T, n_cols: int) -> torch.Tensor:
    """Raw rows [rows, bytes] (uint8, or the float type itself) -> float32 [rows, n_cols]."""
    rows = raw.shape[0]
    if ggml_type in FLOAT_TYPES:
        return raw.contiguous().view(FLOAT_TYPES[ggml_type]).reshape(rows, n_cols).float()
    if ggml_type in (T.Q4_0, T.Q4_1):
        nibbles, scale, offset = split_q4_blocks(raw, ggml_type)
        values = nibbles.reshape(rows, -1, QK).float()
        return (values * scale.unsqueeze(-1) + offset.unsqueeze(-1)).reshape(rows, n_cols)
    if ggml_type == T.Q8_0:
        values, scale = split_q8_blocks(raw)
        return (values.reshape(rows, -1, QK).float() * scale.unsqueeze(-1)).reshape(rows, n_cols)
    flat = quants.dequantize(raw.numpy().astype(np.uint8, copy=False), ggml_type)
    return torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32)).reshape(rows, n_cols)


def row_bytes(ggml_type: T, n_cols: int) -> int:
    block, size = GGML_QUANT_SIZES[ggml_type]
    return n_cols // block * size


# Byte offsets of the float16 fields in a block of each block type (ggml-common.h's layouts).
_HALF_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.Q2_K: (80, 82),
                T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_blocks(ggml_type: T, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Rows of random blocks of a block type, uint8 [rows, bytes]: every bit pattern of the integer
    fields, float16 scales ~ N(0, scale). What kernel checks against gguf.quants.dequantize and
    speed measurements need; gguf cannot quantize to the K-quants."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[ggml_type]:
        halves = (rng.standard_normal((rows, cols // block)) * scale).astype(np.float16)
        raw[..., offset : offset + 2] = halves.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)
