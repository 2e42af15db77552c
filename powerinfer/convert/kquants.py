"""Encoders for GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K), vectorised over super-blocks in numpy.

The `gguf` package decodes these types but has no encoder, so we write our own from the block
layouts (which `gguf.quants.dequantize` reads back; the unit tests check that round trip):

- Q4_K / Q5_K: super-blocks of 256 values = 8 sub-blocks of 32. Value = d·sc·q − dmin·m with
  fp16 `d`, `dmin`, 6-bit sub-block scales `sc` and mins `m` (packed in 12 bytes) and 4-bit
  (Q4_K) or 5-bit (Q5_K: a 32-byte plane of high bits) quants q ≥ 0.
- Q6_K: super-blocks of 256 = 16 sub-blocks of 16. Value = d·sc·(q − 32) with an int8 scale per
  sub-block, one fp16 `d`, and 6-bit quants stored as a 4-bit plane plus a 2-bit plane.

Scales are chosen by search, not from min/max alone: for each sub-block a few candidate steps
around range/levels are tried, each rounding is re-fitted by least squares (scale, and offset for
Q4_K/Q5_K), and the candidate with the least squared error wins. The sub-block scales are then
rounded to their 6- or 8-bit codes, and the values re-rounded against the scales as stored.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QK_K = 256
K_QUANT_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
_CHUNK_VALUES = 1 << 20  # values encoded at a time per thread: bounds the temporaries to tens of MB
# Candidate steps per sub-block: the range spread over levels + delta (delta > 0 clips the
# extremes for finer steps elsewhere, delta < 0 leaves headroom). 21 steps of 0.1 across ±1 level.
_AFFINE_DELTAS = np.linspace(-1.0, 1.0, 21)
_SYMMETRIC_LEVELS = np.linspace(28.0, 36.0, 17)  # Q6_K: |largest value| mapped to this many steps


def _row_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b).astype(np.float64)


def _search_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale ≥ 0, offset ≤ 0) per row of x [N, 32] for quants 0..levels, least squared error.
    For each candidate rounding the least-squares line through (q, x) is fitted; an offset above
    zero is not storable (K-quants subtract a non-negative min), so such rows are fitted through the
    origin instead. Errors come from the sums in closed form, to keep the loop cheap."""
    n = x.shape[-1]
    lo = np.minimum(x.min(-1), 0.0)
    span = x.max(-1) - lo
    shifted = x - lo[:, None]
    sx, sxx = x.sum(-1, dtype=np.float64), _row_dot(x, x)
    best_err = np.full(x.shape[0], np.inf)
    best_scale, best_offset = np.zeros(x.shape[0]), lo.astype(np.float64)
    for delta in _AFFINE_DELTAS:
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(span > 0, (levels + delta) / span, 0.0).astype(np.float32)
        q = np.rint(shifted * inverse[:, None])
        np.clip(q, 0, levels, out=q)
        sq, sqq, sqx = q.sum(-1, dtype=np.float64), _row_dot(q, q), _row_dot(q, x)
        det = n * sqq - sq * sq
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(det > 0, (n * sqx - sq * sx) / det, 0.0)
            offset = np.where(det > 0, (sqq * sx - sq * sqx) / det, sx / n)
            origin_scale = np.where(sqq > 0, sqx / sqq, 0.0)
        positive = offset > 0
        scale = np.maximum(np.where(positive, origin_scale, scale), 0.0)
        offset = np.where(positive, 0.0, offset)
        err = scale * scale * sqq + 2 * scale * offset * sq + n * offset * offset - 2 * scale * sqx - 2 * offset * sx + sxx
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_offset = np.where(better, offset, best_offset)
    return best_scale, best_offset


def _search_symmetric(x: np.ndarray) -> np.ndarray:
    """Signed scale per row of x [N, 16] for quants −32..31, least squared error. The value of
    largest magnitude is mapped near −32, the side with one more level."""
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[:, None], -1)[:, 0]
    sxx = _row_dot(x, x)
    best_err, best_scale = sxx.copy(), np.zeros(x.shape[0])
    for levels in _SYMMETRIC_LEVELS:
        with np.errstate(divide="ignore", invalid="ignore"):
            inverse = np.where(peak != 0, -levels / peak, 0.0).astype(np.float32)
        q = np.rint(x * inverse[:, None])
        np.clip(q, -32, 31, out=q)
        sqx, sqq = _row_dot(q, x), _row_dot(q, q)
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.where(sqq > 0, sqx / sqq, 0.0)
        err = sxx - scale * sqx  # squared error of the least-squares scale
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
    return best_scale


def _fp16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _codes(values: np.ndarray, step: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """round(values / step) clipped to [lo, hi]; 0 where the step is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step != 0, np.rint(values / step), 0.0)
    return np.clip(codes, lo, hi)


def _pack_6bit_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [n, 8] -> 12 bytes [n, 12]. Bytes 0-3 hold scales 0-3 and
    bytes 4-7 mins 0-3 in their low 6 bits; bytes 8-11 hold the low nibbles of scale (low half)
    and min (high half) 4-7, whose top 2 bits go to the top of bytes 0-3 (scales) and 4-7 (mins)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    low = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6)], axis=1)
    return np.concatenate([low, (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1)


def _encode_affine(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Super-blocks x [n, 256] -> (d and dmin as fp16 bytes [n, 4], packed scales [n, 12],
    quants [n, 8, 32])."""
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    scale, offset = _search_affine(sub, levels)
    scale, mins = scale.reshape(n, 8), -offset.reshape(n, 8)
    d = _fp16(scale.max(-1) / 63)
    dmin = _fp16(mins.max(-1) / 63)
    sc = _codes(scale, d.astype(np.float64)[:, None], 0, 63)
    m = _codes(mins, dmin.astype(np.float64)[:, None], 0, 63)
    step = (d.astype(np.float64)[:, None] * sc).reshape(n * 8, 1)
    shift = (dmin.astype(np.float64)[:, None] * m).reshape(n * 8, 1)
    q = _codes(sub + shift, step, 0, levels).astype(np.uint8).reshape(n, 8, 32)
    header = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8)], axis=1)
    return header, _pack_6bit_scales(sc, m), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Quants [n, 8, 32] -> 128 bytes: sub-blocks 2g and 2g+1 share bytes 32g..32g+31 (low, high nibble)."""
    pairs = (q & 0x0F).reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _encode_q4_k(x: np.ndarray) -> np.ndarray:
    header, scales, q = _encode_affine(x, 15)
    return np.concatenate([header, scales, _nibbles(q)], axis=1)


def _encode_q5_k(x: np.ndarray) -> np.ndarray:
    header, scales, q = _encode_affine(x, 31)
    # Bit i of high-bit byte l is bit 4 of sub-block i's quant l.
    high = (((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    return np.concatenate([header, scales, high, _nibbles(q)], axis=1)


def _encode_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n * 16, 16)
    scale = _search_symmetric(sub).reshape(n, 16)
    # The sub-block scale of largest magnitude becomes int8 code −128.
    peak = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)[:, 0]
    d = _fp16(-peak / 128)
    sc = _codes(scale, d.astype(np.float64)[:, None], -128, 127)
    step = (d.astype(np.float64)[:, None] * sc).reshape(n * 16, 1)
    u = (_codes(sub, step, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128
    # Per half: low nibbles of values p and 64+p share byte p; the 2-bit tops of values
    # 32s+p (s = 0..3) share byte p, at bits 2s.
    low = (u[:, :, :64] & 0x0F) | ((u[:, :, 64:] & 0x0F) << 4)
    tops = (u >> 4).reshape(n, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    high = tops.sum(2, dtype=np.uint8)
    return np.concatenate([low.reshape(n, 128), high.reshape(n, 64), sc.astype(np.int8).view(np.uint8),
                           d[:, None].view(np.uint8)], axis=1)


_ENCODERS = {T.Q4_K: _encode_q4_k, T.Q5_K: _encode_q5_k, T.Q6_K: _encode_q6_k}


def quantize_k(array: np.ndarray, ggml_type: T) -> np.ndarray:
    """Rows of `array` (width a multiple of 256) as `ggml_type` blocks: uint8 [rows, bytes per row],
    the layout `gguf.quants.quantize` returns for the types it can encode."""
    encoder = _ENCODERS[ggml_type]
    rows = np.ascontiguousarray(array, dtype=np.float32).reshape(-1, array.shape[-1])
    if rows.shape[1] % QK_K:
        raise ValueError(f"{ggml_type.name} needs rows of a multiple of {QK_K} values, not {rows.shape[1]}")
    blocks_per_row = rows.shape[1] // QK_K
    out = np.empty((rows.shape[0], blocks_per_row * GGML_QUANT_SIZES[ggml_type][1]), dtype=np.uint8)
    step = max(1, _CHUNK_VALUES // rows.shape[1])

    def encode_chunk(start: int) -> None:
        chunk = rows[start:start + step]
        out[start:start + step] = encoder(chunk.reshape(-1, QK_K)).reshape(chunk.shape[0], -1)

    # numpy releases the GIL in its array loops, so chunks encode in parallel on threads.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(encode_chunk, range(0, rows.shape[0], step)))
    return out.reshape(*array.shape[:-1], -1)
