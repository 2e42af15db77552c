"""Neuron-aware sparse operators: native kernels against their plain-torch references and exact math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer.config import FFNActivation
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops.activation import activate
from powerinfer.ops import native
from powerinfer.ops import neuron as N

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.F32, T.F16, T.Q5_1]


def tensor(rng, rows, cols, ggml_type) -> tuple[GGUFTensor, torch.Tensor]:
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if ggml_type == T.F32:
        raw = w
    elif ggml_type == T.F16:
        raw = w.astype(np.float16)
    else:
        raw = quants.quantize(w, ggml_type)
    return GGUFTensor("w", ggml_type, (rows, cols), raw), torch.from_numpy(quants.dequantize(raw, ggml_type).astype(np.float32))


def store(seed, ggml_type, n_ff, d_in, d_out, gated=True):
    rng = np.random.default_rng(seed)
    (g, gw), (u, uw), (dt, dw) = tensor(rng, n_ff, d_in, ggml_type), tensor(rng, n_ff, d_in, ggml_type), tensor(rng, n_ff, d_out, ggml_type)
    return N.NeuronStore(g if gated else None, u, dt), (gw if gated else None, uw, dw)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_records_hold_the_exact_weights(ggml_type):
    s, (gw, uw, dw) = store(0, ggml_type, 70, 96, 64)
    expected_down = dw if ggml_type != T.Q5_1 else torch.from_numpy(  # re-encoded as Q8_0
        quants.dequantize(quants.quantize(dw.numpy(), T.Q8_0), T.Q8_0))
    assert torch.equal(s.weights(s.gate), gw) if ggml_type != T.Q5_1 else s.gate.bits == 8
    assert torch.equal(s.weights(s.down), expected_down)
    assert s.records.shape == (70, s.record_bytes) and s.record_bytes % 64 == 0


needs_native = pytest.mark.skipif(native.load() is None, reason="native operators could not be built here")


@needs_native
@settings(max_examples=40, deadline=None)
@given(ggml_type=st.sampled_from([T.Q4_0, T.Q4_1, T.Q8_0, T.F32]), blocks=st.integers(1, 20), n_ff=st.integers(1, 90),
       tokens=st.integers(1, 3), seed=st.integers(0, 1000), data=st.data())
def test_native_operators_equal_references(ggml_type, blocks, n_ff, tokens, seed, data):
    s, _ = store(seed, ggml_type, n_ff, 32 * blocks, 32 * max(1, blocks // 2))
    idx = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n_ff - 1), min_size=1))), dtype=torch.int64)
    x = torch.randn(tokens, 32 * blocks, generator=torch.Generator().manual_seed(seed))
    a = torch.randn(tokens, len(idx), generator=torch.Generator().manual_seed(seed + 1))
    ops = native.load()
    y = ops.gather_matvec(s.records, s.up.as_list(), x, idx)
    torch.testing.assert_close(y, N.gather_matvec_reference(s, s.up, x, idx), rtol=1e-4, atol=1e-4)
    z = ops.accumulate_rows(s.records, s.down.as_list(), a, idx)
    torch.testing.assert_close(z, N.accumulate_rows_reference(s, s.down, a, idx), rtol=1e-4, atol=1e-4)
    # float32 rounding bounds: each dot is accurate to ~1e-6 of the sum of its |terms|, so an
    # activation to ~1e-6 of |gate terms| * |up terms|, and the output to that times max|w_down|
    # per row (the kernel adds a*d*q and a*m separately), whatever cancellation the result has.
    x_abs = x.abs()
    terms = (x_abs @ s.weights(s.gate, idx).abs().T) * (x_abs @ s.weights(s.up, idx).abs().T)
    down = s.weights(s.down, idx).abs()
    bound = 1e-5 * (terms @ down.amax(1, keepdim=True).expand_as(down)) + 1e-5
    for activation in (FFNActivation.SILU_GATED, FFNActivation.RELU_GATED, FFNActivation.DRELU):
        f = N.sparse_ffn(s, activation, x, idx)
        assert torch.all((f - N.sparse_ffn_reference(s, activation, x, idx)).abs() <= bound)

@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q8_0, T.F32])
def test_sparse_ffn_over_all_neurons_equals_dense_ffn(ggml_type):
    """The operator's only approximation is rounding x to 8 bits per block of 32 (as llama.cpp)."""
    s, (gw, uw, dw) = store(3, ggml_type, 120, 128, 96)
    x = torch.randn(2, 128)
    dense = activate(torch.cat([x @ gw.T, x @ uw.T], -1), FFNActivation.SILU_GATED) @ dw
    sparse = N.sparse_ffn(s, FFNActivation.SILU_GATED, x, torch.arange(120))
    scale = (activate(torch.cat([x @ gw.T, x @ uw.T], -1), FFNActivation.SILU_GATED).abs() @ dw.abs()).max()
    assert (sparse - dense).abs().max() <= (1e-5 if ggml_type == T.F32 else 0.02) * scale


def test_skipping_zero_neurons_changes_nothing():
    """ReLU: computing only the neurons that fire equals computing all of them."""
    s, (gw, uw, dw) = store(4, T.F32, 200, 64, 64)
    x = torch.randn(1, 64)
    fired = torch.nonzero((x @ gw.T)[0] > 0).flatten()
    everything = N.sparse_ffn(s, FFNActivation.RELU_GATED, x, torch.arange(200))
    only_fired = N.sparse_ffn(s, FFNActivation.RELU_GATED, x, fired)
    torch.testing.assert_close(only_fired, everything, rtol=1e-4, atol=1e-4)


def test_non_gated_ffn():
    s, (_, uw, dw) = store(5, T.F32, 50, 64, 32, gated=False)
    x = torch.randn(1, 64)
    torch.testing.assert_close(N.sparse_ffn(s, FFNActivation.RELU, x, torch.arange(50)), torch.relu(x @ uw.T) @ dw,
                               rtol=1e-4, atol=1e-4)


@needs_native
def test_bad_indices_are_rejected():
    s, _ = store(6, T.Q4_0, 10, 64, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        N.sparse_ffn(s, FFNActivation.SILU_GATED, torch.randn(1, 64), torch.tensor([3, 10]))
