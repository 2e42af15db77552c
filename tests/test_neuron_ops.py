"""Neuron-aware sparse operators: native kernels (each instruction set) against their plain-torch
references, gguf.quants' dequantization and exact math."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer.config import FFNActivation
from powerinfer.ops import native
from powerinfer.sparse import neurons as N
from powerinfer.sparse.neurons import activate

from helpers import BLOCK_TYPES, random_store

TYPES = [*BLOCK_TYPES, T.F32, T.F16]
K_QUANTS = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}


@pytest.mark.parametrize("ggml_type", TYPES)
def test_records_hold_the_exact_weights(ggml_type):
    s, (gw, uw, dw) = random_store(0, ggml_type, 70, 256, 512)
    assert torch.equal(s.weights(s.gate), gw) and torch.equal(s.weights(s.down), dw)
    assert s.records.shape == (70, s.record_bytes) and s.record_bytes % 64 == 0
    row_bytes = [N.record_row_bytes(ggml_type, n) for n in (256, 256, 512)]
    assert s.record_bytes == -(-sum(row_bytes) // 64) * 64  # K-quants as compact as in the file


needs_native = pytest.mark.skipif(native.load() is None, reason="native operators could not be built here")


@needs_native
def test_the_native_activation_table_is_ffn_activation():
    """csrc/common.h numbers the activations that powerinfer.config.FFNActivation names: the
    bindings export them by those names, so neither side can gain or lose one alone."""
    assert set(native.load().Activation.__members__) == {a.name for a in FFNActivation}
    assert len({int(native.activation(a)) for a in FFNActivation}) == len(FFNActivation)


def operator_case(ggml_type, blocks, n_ff, tokens, seed, data):
    block = 256 if ggml_type in K_QUANTS else 32
    s, _ = random_store(seed, ggml_type, n_ff, block * blocks, block * max(1, blocks // 2))
    idx = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n_ff - 1), min_size=1))), dtype=torch.int64)
    x = torch.randn(tokens, block * blocks, generator=torch.Generator().manual_seed(seed))
    a = torch.randn(tokens, len(idx), generator=torch.Generator().manual_seed(seed + 1))
    return s, idx, x, a


@needs_native
@settings(max_examples=40, deadline=None)
@given(ggml_type=st.sampled_from([*BLOCK_TYPES, T.F32]), blocks=st.integers(1, 9), n_ff=st.integers(1, 90),
       tokens=st.integers(1, 3), seed=st.integers(0, 1000), data=st.data())
def test_native_operators_equal_references(ggml_type, blocks, n_ff, tokens, seed, data):
    """On every instruction set: the kernels' arithmetic (x rounded to int8 per 32) to float32
    rounding, with block counts that are not multiples of the kernels' 2, 4 or 16 blocks per step."""
    s, idx, x, a = operator_case(ggml_type, blocks, n_ff, tokens, seed, data)
    ops = native.load()
    matvec, accumulated = N.gather_matvec_reference(s, s.up, x, idx), N.accumulate_rows_reference(s, s.down, a, idx)
    # float32 rounding bounds: each dot is accurate to ~1e-6 of the sum of its |terms|, so an
    # activation to ~1e-6 of |gate terms| * |up terms|, and the output to that times max|w_down|
    # per row (the kernel adds a*d*q and a*m separately), whatever cancellation the result has.
    x_abs = x.abs()
    up_terms = x_abs @ s.weights(s.up, idx).abs().T
    terms = (x_abs @ s.weights(s.gate, idx).abs().T) * up_terms
    down = s.weights(s.down, idx).abs()
    bound = 1e-5 * (terms @ down.amax(1, keepdim=True).expand_as(down)) + 1e-5
    references = {activation: N.sparse_ffn_reference(s, activation, x, idx)
                  for activation in (FFNActivation.SILU_GATED, FFNActivation.RELU_GATED, FFNActivation.DRELU)}
    for isa in native.instruction_sets():
        with native.instruction_set(isa):
            y = ops.gather_matvec(s.records, s.up.as_list(), x, idx)
            assert torch.all((y - matvec).abs() <= 1e-5 * up_terms + 1e-5), isa
            z = ops.accumulate_rows(s.records, s.down.as_list(), a, idx)
            assert torch.all((z - accumulated).abs() <= 1e-5 * (a.abs() @ down) + 1e-5), isa
            for activation, reference in references.items():
                assert torch.all((N.sparse_ffn(s, activation, x, idx) - reference).abs() <= bound), (isa, activation)


@needs_native
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("blocks", [1, 2, 7, 8, 9, 17, 128])
def test_simd_kernels_equal_scalar_kernels(ggml_type, blocks):
    """Each SIMD path against the scalar one, on rows of block counts around the SIMD kernels' steps
    (pairs of blocks, groups of 8 scales) and neuron counts around the 4 rows accumulated together:
    the same integer products, so only float32 summation order differs."""
    ops = native.load()
    n_ff = 11
    s, _ = random_store(blocks, ggml_type, n_ff, 32 * blocks, 32 * blocks)
    x = torch.randn(1, 32 * blocks, generator=torch.Generator().manual_seed(blocks))
    a = torch.randn(1, n_ff, generator=torch.Generator().manual_seed(blocks + 1))
    everything = torch.arange(n_ff)
    x_terms = x.abs() @ s.weights(s.up).abs().T
    down_terms = a.abs() @ s.weights(s.down).abs()

    def run():
        return (ops.gather_matvec(s.records, s.up.as_list(), x, everything),
                ops.accumulate_rows(s.records, s.down.as_list(), a, everything),
                [N.sparse_ffn(s, FFNActivation.SILU_GATED, x, everything[:n]) for n in range(1, n_ff + 1)])

    with native.instruction_set("scalar"):
        matvec, accumulated, ffns = run()
    for isa in native.instruction_sets()[:-1]:
        with native.instruction_set(isa):
            y, z, ys = run()
        assert torch.all((y - matvec).abs() <= 1e-5 * x_terms + 1e-6), isa
        assert torch.all((z - accumulated).abs() <= 1e-5 * down_terms + 1e-6), isa
        for n, (got, want) in enumerate(zip(ys, ffns), 1):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()), msg=f"{isa}, {n} neurons")


@needs_native
@settings(max_examples=20, deadline=None)
@given(ggml_type=st.sampled_from(sorted(K_QUANTS | {T.Q5_0, T.Q5_1})), blocks=st.integers(1, 3), n_ff=st.integers(1, 40),
       seed=st.integers(0, 1000), data=st.data())
def test_block_type_records_equal_dequantized_float_products(ggml_type, blocks, n_ff, seed, data):
    """Against gguf.quants' dequantization times a float64 matmul: the only difference is x rounded
    to int8 per 32 inputs, at most half a step (scale / 2) per input."""
    s, idx, x, a = operator_case(ggml_type, blocks, n_ff, 2, seed, data)
    w_up, w_down = s.weights(s.up, idx).double(), s.weights(s.down, idx).double()
    half_step = (x.abs().view(2, -1, 32).amax(-1) / 127 / 2).repeat_interleave(32, dim=1).double()
    for isa in native.instruction_sets():
        with native.instruction_set(isa):
            y = N.gather_matvec(s, s.up, x, idx).double()
            z = N.accumulate_rows(s, s.down, a, idx).double()
        assert torch.all((y - x.double() @ w_up.T).abs() <= half_step @ w_up.abs().T * 1.01 + 1e-4), isa
        assert torch.all((z - a.double() @ w_down).abs() <= 1e-5 * (a.double().abs() @ w_down.abs()) + 1e-5), isa

@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.F32])
def test_sparse_ffn_over_all_neurons_equals_dense_ffn(ggml_type):
    """The operator's only approximation is rounding x to 8 bits per block of 32 (as llama.cpp)."""
    s, (gw, uw, dw) = random_store(3, ggml_type, 120, 256, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(ggml_type))  # seeded: a few draws exceed the bound for Q4_K
    dense = activate(torch.cat([x @ gw.T, x @ uw.T], -1), FFNActivation.SILU_GATED) @ dw
    sparse = N.sparse_ffn(s, FFNActivation.SILU_GATED, x, torch.arange(120))
    scale = (activate(torch.cat([x @ gw.T, x @ uw.T], -1), FFNActivation.SILU_GATED).abs() @ dw.abs()).max()
    assert (sparse - dense).abs().max() <= (1e-5 if ggml_type == T.F32 else 0.02) * scale


def test_skipping_zero_neurons_changes_nothing():
    """ReLU: computing only the neurons that fire equals computing all of them."""
    s, (gw, uw, dw) = random_store(4, T.F32, 200, 64, 64)
    x = torch.randn(1, 64)
    fired = torch.nonzero((x @ gw.T)[0] > 0).flatten()
    everything = N.sparse_ffn(s, FFNActivation.RELU_GATED, x, torch.arange(200))
    only_fired = N.sparse_ffn(s, FFNActivation.RELU_GATED, x, fired)
    torch.testing.assert_close(only_fired, everything, rtol=1e-4, atol=1e-4)


def test_non_gated_ffn():
    s, (_, uw, dw) = random_store(5, T.F32, 50, 64, 32, gated=False)
    x = torch.randn(1, 64)
    torch.testing.assert_close(N.sparse_ffn(s, FFNActivation.RELU, x, torch.arange(50)), torch.relu(x @ uw.T) @ dw,
                               rtol=1e-4, atol=1e-4)


@needs_native
def test_bad_indices_are_rejected():
    s, _ = random_store(6, T.Q4_0, 10, 64, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        N.sparse_ffn(s, FFNActivation.SILU_GATED, torch.randn(1, 64), torch.tensor([3, 10]))
