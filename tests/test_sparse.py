"""Sparse FFN inference: oracle and predictor modes against dense computation."""

from __future__ import annotations

import pytest
import torch

from powerinfer.config import FFNActivation
from powerinfer.errors import PowerInferError
from powerinfer.sparse.ffn import DenseFFN, SparseFFN

from helpers import decode_logits, engine

N_CTX = 128


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def relu_llama(tiny_llama):
    hf_model, folder, ggufs = tiny_llama
    if hf_model.config.hidden_act != "relu":
        pytest.skip("ReLU model only")
    return ggufs


def test_modes_build_the_ffns_they_name(relu_llama):
    assert all(isinstance(b.ffn, DenseFFN) for b in engine(relu_llama["q4_0"], sparsity="auto").model.blocks)
    oracle = engine(relu_llama["q4_0"], sparsity="oracle").model.blocks
    assert all(isinstance(b.ffn, SparseFFN) and b.ffn.mode == "oracle" for b in oracle)


def test_oracle_equals_dense_for_relu_float_model(relu_llama, ids):
    """ReLU: skipping exactly the neurons that do not fire changes nothing."""
    dense = decode_logits(engine(relu_llama["f32"], sparsity="off"), ids)
    sparse_engine = engine(relu_llama["f32"], sparsity="oracle")
    oracle = decode_logits(sparse_engine, ids)
    torch.testing.assert_close(oracle, dense, rtol=1e-4, atol=1e-4)
    computed = [b.ffn.last_active for b in sparse_engine.model.blocks]
    assert all(0 < n < b.ffn.store.n_ff for n, b in zip(computed, sparse_engine.model.blocks))  # really sparse


def test_oracle_equals_all_neurons_on_the_same_quantized_records(relu_llama, ids):
    oracle = decode_logits(engine(relu_llama["q4_0"], sparsity="oracle"), ids)
    everything = engine(relu_llama["q4_0"], sparsity="oracle", thresholds=(-1.0, -1.0))  # nothing skipped
    # Summation order differs; the bfloat16 roundings downstream may move a logit by one ulp.
    torch.testing.assert_close(oracle, decode_logits(everything, ids), rtol=1e-2, atol=1e-2)


def test_oracle_on_silu_model_needs_thresholds(tiny_llama):
    hf_model, _, ggufs = tiny_llama
    if hf_model.config.hidden_act != "silu":
        pytest.skip("SiLU model only")
    with pytest.raises(PowerInferError, match="needs calibrated thresholds"):
        engine(ggufs["q4_0"], sparsity="oracle")
    assert engine(ggufs["q4_0"], sparsity="oracle", thresholds=(0.01, 0.01)).model.blocks[0].ffn.selector.threshold == 0.01


def test_prefill_skips_the_same_neurons_as_token_by_token_decode(tiny_llama, ids):
    """Many rows run as masked dense GEMMs: the same neurons skipped per token as in decode."""
    _, _, ggufs = tiny_llama
    thresholds = (0.05, 0.05)
    sparse, dense = engine(ggufs["f32"], sparsity="oracle", thresholds=thresholds), engine(ggufs["f32"], sparsity="off")
    prefilled = sparse.all_logits(ids)
    decoded = decode_logits(engine(ggufs["f32"], sparsity="oracle", thresholds=thresholds), ids, prompt=1)
    torch.testing.assert_close(prefilled, decoded, rtol=1e-4, atol=1e-4)
    assert (prefilled - dense.all_logits(ids)).abs().max() > 1e-3  # neurons really were skipped


@pytest.mark.parametrize("activation", [FFNActivation.RELU_GATED, FFNActivation.DRELU, FFNActivation.RELU])
def test_one_token_native_call_equals_the_python_steps(activation):
    """PowerInfer's quantized predictors (Q4_0): a token's predictor, choice of neurons and sparse FFN
    run as one native call, with the Python steps' result bit for bit."""
    from gguf import GGMLQuantizationType as T

    from powerinfer.ops import native
    from powerinfer.ops.linear import build_linear
    from powerinfer.sparse.ffn import union
    from powerinfer.sparse.neurons import NeuronStore, sparse_ffn, sparse_ffn_reference
    from powerinfer.sparse.predictor import Predictor
    from powerinfer.sparse.select import Predicted

    from conftest import quantized_rows

    if native.load() is None:
        pytest.skip("native operators unavailable")
    d, n_ff, rank = 128, 320, 64
    gate = quantized_rows(T.Q4_0, n_ff, d, seed=1) if activation.is_gated else None
    store = NeuronStore(gate, quantized_rows(T.Q4_0, n_ff, d, seed=2), quantized_rows(T.Q4_0, n_ff, d, seed=3))
    predictor = Predictor(build_linear([quantized_rows(T.Q4_0, rank, d, seed=4)]),
                          build_linear([quantized_rows(T.Q4_0, n_ff, rank, seed=5)]), threshold=2.0)
    ffn = SparseFFN(store, activation, Predicted(predictor))
    assert ffn._predicted is not None  # the native call, not the Python steps it is compared with
    h, x = torch.randn(2, 1, d, generator=torch.Generator().manual_seed(6))
    fused = ffn(h, x)
    fired = predictor.fires(x)
    idx = union(fired)
    assert 0 < len(idx) < n_ff and ffn.last_active == len(idx)
    assert torch.equal(fused, sparse_ffn(store, activation, h, idx, fired[:, idx]))
    reference = sparse_ffn_reference(store, activation, h, idx)  # plain torch, x rounded as the kernels do
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
