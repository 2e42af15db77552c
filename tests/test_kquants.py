"""Our K-quant encoders, read back by the `gguf` package's decoders (a reference nobody here wrote)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T

from powerinfer.convert.encode import encode_tensor
from powerinfer.convert.kquants import quantize_k

# Each K type against `gguf.quants`' own encoder of a type with as many bits per value or more
# (4.5, 5.5, 6 bits: round-to-nearest over blocks of 32): a searched K-quant must not be worse.
NO_WORSE_THAN = {T.Q4_K: T.Q4_0, T.Q5_K: T.Q5_0, T.Q6_K: T.Q5_1}


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Gaussian weights with 1 % outliers (as in trained matrices), at a typical magnitude."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    x[rng.random(x.shape) < 0.01] *= 8
    return x


def rms(a: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))


@pytest.mark.parametrize("ggml_type", list(NO_WORSE_THAN))
@pytest.mark.parametrize("shape", [(1, 256), (37, 512), (5, 1536)])
def test_decoded_by_gguf_close_to_input(ggml_type, shape):
    x = weights(*shape, seed=shape[0])
    raw = quantize_k(x, ggml_type)
    block, size = GGML_QUANT_SIZES[ggml_type]
    assert raw.dtype == np.uint8 and raw.shape == (shape[0], shape[1] // block * size)
    decoded = quants.dequantize(raw, ggml_type)
    assert decoded.shape == x.shape
    reference = quants.dequantize(quants.quantize(x, NO_WORSE_THAN[ggml_type]), NO_WORSE_THAN[ggml_type])
    assert rms(decoded - x) <= rms(reference - x)
    # Every value lands near its own: a misplaced quant or scale would be off by the data's size.
    peaks = np.abs(x).reshape(shape[0], -1, 256).max(-1, keepdims=True)
    assert np.all(np.abs(decoded - x).reshape(shape[0], -1, 256) <= 0.1 * peaks)


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_K])
def test_affine_types_beat_min_max_rounding(ggml_type):
    """The scale search against the textbook bound of min/max rounding: with steps of
    (max − min) / levels per 32 values, the rounding error is uniform, RMS = step / √12."""
    x = weights(64, 512, seed=7)
    levels = 15 if ggml_type == T.Q4_K else 31
    sub = x.reshape(-1, 32).astype(np.float64)
    step = (sub.max(1) - np.minimum(sub.min(1), 0)) / levels
    decoded = quants.dequantize(quantize_k(x, ggml_type), ggml_type)
    assert rms(decoded - x) < 0.95 * np.sqrt(np.mean(step**2) / 12)


@pytest.mark.parametrize("ggml_type", list(NO_WORSE_THAN))
@pytest.mark.parametrize("fill", [0.0, 0.5, -0.25])
def test_constant_rows(ggml_type, fill):
    x = np.full((3, 512), fill, dtype=np.float32)
    decoded = quants.dequantize(quantize_k(x, ggml_type), ggml_type)
    np.testing.assert_allclose(decoded, x, atol=abs(fill) * 2e-3)


@pytest.mark.parametrize("ggml_type", list(NO_WORSE_THAN))
def test_one_sided_and_mixed_magnitude_blocks(ggml_type):
    """All-positive and all-negative super-blocks, and sub-blocks 1000× apart in one super-block."""
    x = np.abs(weights(4, 768, seed=3))
    x[1] *= -1
    x[2, :32] *= 1000
    decoded = quants.dequantize(quantize_k(x, ggml_type), ggml_type)
    for row in (0, 1):
        assert rms(decoded[row] - x[row]) < 0.1 * rms(x[row])
    assert rms(decoded[2, :32] - x[2, :32]) < 0.1 * rms(x[2, :32])


def test_rejects_partial_super_blocks():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 320), np.float32), T.Q4_K)


@pytest.mark.parametrize("ggml_type, width, stored", [
    (T.Q4_K, 512, T.Q4_K), (T.Q4_K, 96, T.Q5_0), (T.Q5_K, 96, T.Q5_1), (T.Q6_K, 288, T.Q8_0),
    (T.Q6_K, 40, T.F16), (T.Q4_0, 40, T.F16),
])
def test_rows_that_do_not_fill_blocks_fall_back_as_llama_quantize(ggml_type, width, stored):
    x = weights(8, width, seed=width)
    tensor = encode_tensor("w.weight", x, ggml_type)
    assert tensor.ggml_type == stored
    decoded = tensor.data.astype(np.float32) if stored == T.F16 else quants.dequantize(tensor.data, stored)
    assert rms(decoded - x) < 0.12 * rms(x)
