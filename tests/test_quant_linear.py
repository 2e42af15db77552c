"""QuantLinear: our native Q4_0/Q4_1/Q8_0 kernel against its plain-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops.linear import QuantLinear, mapped_tensor, pack_quant, quant_kernel
from powerinfer.ops.quant import split_q4_blocks, split_q8_blocks

pytestmark = pytest.mark.skipif(quant_kernel() is None, reason="no AVX-512 bfloat16 kernel on this machine")


def quantized(rows: int, cols: int, ggml_type: T, seed: int) -> GGUFTensor:
    array = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return GGUFTensor("w", ggml_type, (rows, cols), quants.quantize(array, ggml_type))


def summed_magnitude(x: torch.Tensor, tensor: GGUFTensor) -> torch.Tensor:
    """sum_k |x_k| (|d| |q_k| + |m|): what float32 rounding in the kernel is relative to."""
    raw = mapped_tensor(tensor.data.view(np.uint8).reshape(tensor.shape[0], -1))
    if tensor.ggml_type == T.Q8_0:
        values, scale = split_q8_blocks(raw)
        parts = values.float().abs() * scale.abs().repeat_interleave(32, dim=1)
    else:
        nibbles, scale, offset = split_q4_blocks(raw, tensor.ggml_type)
        parts = nibbles.float() * scale.abs().repeat_interleave(32, 1) + offset.abs().repeat_interleave(32, 1)
    return x.double().abs() @ parts.double().T


@settings(max_examples=30, deadline=None)
@given(
    ggml_type=st.sampled_from([T.Q4_0, T.Q4_1, T.Q8_0]),
    rows=st.integers(1, 100),
    blocks=st.integers(1, 6),
    tokens=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_reference(ggml_type, rows, blocks, tokens, seed):
    cols = 32 * blocks
    tensor = quantized(rows, cols, ggml_type, seed)
    layer = pack_quant([tensor])
    assert isinstance(layer, QuantLinear) and (layer.out_features, layer.in_features) == (rows, cols)
    # The repacked layout holds exactly the file's weights.
    np.testing.assert_array_equal(layer.dequantized().numpy(), quants.dequantize(tensor.data, ggml_type))
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    expected = x.double() @ layer.dequantized().double().T
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (tokens, rows)
    bound = 2 * cols * 2.0**-24 * summed_magnitude(x, tensor)  # float32 summation error
    assert torch.all((got.double() - expected).abs() <= bound)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_each_row_gets_its_single_row_result_exactly(ggml_type):
    """What keeps batched decoding equal to decoding alone: rows do not affect each other."""
    layer = pack_quant([quantized(77, 96, ggml_type, seed=1)])
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(2))  # two blocks of 8 rows, then 3
    together = layer(x)
    for row in range(19):
        assert torch.equal(together[row], layer(x[row : row + 1])[0])


def test_stacked_tensors_of_both_4_bit_types():
    tensors = [quantized(40, 64, T.Q4_0, seed=3), quantized(24, 64, T.Q4_1, seed=4)]
    layer = pack_quant(tensors)
    expected = np.concatenate([quants.dequantize(t.data, t.ggml_type) for t in tensors])
    np.testing.assert_array_equal(layer.dequantized().numpy(), expected)


def test_q4_0_scale_beyond_float16_offsets_is_refused():
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)  # offset -8 * d overflows float16
    with pytest.raises(UnsupportedModelError, match="too large"):
        pack_quant([GGUFTensor("w", T.Q4_0, (1, 32), block.reshape(1, 18))])
