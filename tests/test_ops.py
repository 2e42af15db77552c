"""Dequantization and linear kernels against the gguf package's reference implementation."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st

import powerinfer.ops.linear as linear_module
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops.linear import (
    ConcatLinear,
    DenseLinear,
    Int4Linear,
    QuantLinear,
    _pack_nibbles_avx512,
    _pack_nibbles_reference,
    build_linear,
    mapped_tensor,
    pack_nibbles,
    quant_kernel,
)
from powerinfer.ops.quant import dequantize_rows

from helpers import random_tensor


def random_matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def encoded(array: np.ndarray, ggml_type: T) -> np.ndarray:
    if ggml_type == T.F32:
        return array
    if ggml_type == T.F16:
        return array.astype(np.float16)
    return quants.quantize(array, ggml_type)


@pytest.mark.parametrize("ggml_type", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
def test_dequantize_rows_equals_gguf_quants(ggml_type):
    array = random_matrix(37, 256, seed=int(ggml_type))
    raw = encoded(array, ggml_type)
    expected = quants.dequantize(raw, ggml_type).astype(np.float32)
    ours = dequantize_rows(mapped_tensor(raw.view(np.uint8).reshape(37, -1)), ggml_type, 256)
    np.testing.assert_array_equal(ours.numpy(), expected)


def test_int4_packing_equals_torch_packing_on_this_cpu():
    """torch packs int4 weights in a layout of its CPU kernel's instruction set: our byte-op packing
    is the AVX-512 one, used where torch's is that, and torch's own elsewhere (AVX2, plain)."""
    nibbles = torch.randint(0, 16, (192, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(pack_nibbles(nibbles), _pack_nibbles_reference(nibbles))
    fast = torch.equal(_pack_nibbles_avx512(nibbles), _pack_nibbles_reference(nibbles))
    assert fast == (torch.backends.cpu.get_cpu_capability() == "AVX512")


@settings(max_examples=25, deadline=None)
@given(
    ggml_type=st.sampled_from([T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16]),
    rows=st.integers(1, 150),
    blocks=st.integers(1, 6),
    tokens=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    torch_kernel=st.booleans(),
)
def test_linear_matches_dequantized_reference(ggml_type, rows, blocks, tokens, seed, torch_kernel):
    """Either kernel for quantized weights: ours (QuantLinear) where built, torch's int4 kernel elsewhere."""
    cols = 32 * blocks
    raw = encoded(random_matrix(rows, cols, seed), ggml_type)
    weight = torch.from_numpy(quants.dequantize(raw, ggml_type).astype(np.float32))
    with mock.patch.object(linear_module, "quant_kernel", (lambda: None) if torch_kernel else quant_kernel):
        layer = build_linear([GGUFTensor("w", ggml_type, (rows, cols), raw)])
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed))
    expected = x @ weight.T
    got = layer(x).float()
    assert got.shape == (tokens, rows)
    # Rounding error is relative to the sum of |x_i * w_i|, not to the (possibly cancelling) result.
    magnitude = x.abs() @ weight.abs().T
    # float16 rounds inputs and outputs to 11 bits; both quantized kernels round activations to
    # bfloat16 (8 bits), torch's int4 kernel its scales and outputs too.
    relative = {T.F32: 1e-5, T.F16: 2e-3}.get(ggml_type, 1e-2)
    assert torch.all((got - expected).abs() <= relative * magnitude + 1e-5)
    quantized_class = Int4Linear if torch_kernel or quant_kernel() is None else QuantLinear
    assert isinstance(layer, quantized_class) == (ggml_type not in (T.F32, T.F16))


def test_fused_linear_of_mixed_types_concatenates_outputs():
    a, b = random_matrix(64, 64, 1), random_matrix(40, 64, 2)
    parts = [GGUFTensor("a", T.Q4_0, (64, 64), encoded(a, T.Q4_0)), GGUFTensor("b", T.F32, (40, 64), b)]
    layer = build_linear(parts)
    assert isinstance(layer, ConcatLinear) and layer.out_features == 104
    x = torch.randn(3, 64)
    expected = torch.cat([x @ torch.from_numpy(quants.dequantize(encoded(a, T.Q4_0), T.Q4_0)).T, x @ torch.from_numpy(b).T], -1)
    assert (layer(x).float() - expected).abs().max() <= 0.02 * expected.abs().max()


def test_float32_mode_is_exact():
    raw = encoded(random_matrix(70, 96, 5), T.Q4_1)
    layer = build_linear([GGUFTensor("w", T.Q4_1, (70, 96), raw)], float32=True)
    assert isinstance(layer, DenseLinear) and layer.weight.dtype == torch.float32
    x = torch.randn(2, 96)
    torch.testing.assert_close(layer(x), x @ torch.from_numpy(quants.dequantize(raw, T.Q4_1)).T)


def test_stacked_tensors_pack_in_chunks_like_one_matrix(monkeypatch):
    """q/k/v (or gate/up) are packed as one matrix, a chunk of rows at a time."""
    import powerinfer.ops.linear as linear

    parts = [random_matrix(rows, 64, seed) for seed, rows in enumerate((70, 130, 9))]
    tensors = [GGUFTensor(f"w{i}", T.Q4_1, p.shape, encoded(p, T.Q4_1)) for i, p in enumerate(parts)]
    x = torch.randn(2, 64)
    whole = build_linear(tensors)(x)
    monkeypatch.setattr(linear, "PACK_CHUNK_ROWS", 64)
    chunked = build_linear(tensors)(x)
    assert chunked.shape == (2, 209) and torch.equal(chunked, whole)
    expected = x @ torch.cat([torch.from_numpy(quants.dequantize(t.data, T.Q4_1)) for t in tensors]).T
    assert (whole.float() - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.skipif(quant_kernel() is None, reason="needs the native module")
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q6_K])
def test_repacking_in_slices_gives_the_same_layer(ggml_type):
    """A tensor over REPACK_SLICE_BYTES is repacked a slice of rows at a time (its file pages
    dropped after each): the same bytes, the same products, bit for bit."""
    tensor, _ = random_tensor(np.random.default_rng(7), 200, 256, ggml_type)
    whole = build_linear([tensor])
    released = []
    with mock.patch.object(linear_module, "REPACK_SLICE_BYTES", tensor.n_bytes // 5):
        sliced = build_linear([tensor], release_pages=lambda: released.append(True))
    assert len(sliced.projection.chunks) > 1 and len(released) == len(sliced.projection.chunks)
    assert sliced.nbytes == whole.nbytes
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sliced(x), whole(x))
