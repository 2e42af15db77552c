"""The CUDA paths against the CPU: int4 projections, hot neurons in the CUDA layout, and whole hybrid
models (dense parts and hot neurons on the GPU) against the CPU-only model.

Runs where torch sees a CUDA device (the lent GPU machine, `docs/hybrid.md` says how); elsewhere the
same executor is tested with the CPU standing in for the accelerator (tests/test_hybrid.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer import LLM
from powerinfer.config import FFNActivation
from powerinfer.ops.linear import CPU, build_linear, device_linear_bytes
from powerinfer.sparse.hybrid import HybridFFN, KernelNeurons, RecordNeurons
from powerinfer.sparse.select import AboveThreshold

from helpers import decode_and_prefill_logits, place_everything, random_store, random_tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
N_CTX = 64


def assert_close_relative(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    scale = expected.abs().max().item() + 1e-6
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.F32])
@pytest.mark.parametrize("cols", [96, 256])  # the CUDA layout's k-tiles: 2 for 96 inputs, 8 for 256
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_projection_on_cuda_equals_the_cpu_one(ggml_type, cols, rows):
    rng = np.random.default_rng(cols + rows)
    weight, exact = random_tensor(rng, 200, cols, ggml_type)  # 200 outputs: padded to whole blocks
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    on_cpu, on_cuda = build_linear([weight]), build_linear([weight], device=CUDA)
    got = on_cuda(x.to(CUDA))
    assert got.device.type == "cuda" and got.shape == (rows, 200)
    bf16 = ggml_type not in (T.F16, T.F32)  # the int4 kernels round inputs and outputs to bfloat16
    assert_close_relative(got, on_cpu(x), 2e-2 if bf16 else 1e-3)
    assert_close_relative(got, x @ exact.T, 2e-2 if bf16 else 1e-3)
    # what the placement cost model counts for it (the CPU's own kernel keeps another layout)
    assert on_cuda.nbytes == device_linear_bytes([weight])


@settings(max_examples=30, deadline=None)
@given(ggml_type=st.sampled_from([T.Q4_0, T.Q4_1, T.Q8_0, T.F32]), gated=st.booleans(),
       masked=st.booleans(), oracle=st.booleans(), rows=st.sampled_from([1, 3, 12]), seed=st.integers(0, 1000),
       data=st.data())
def test_kernel_neurons_on_cuda_equal_the_cpu_ones(ggml_type, gated, masked, oracle, rows, seed, data):
    """The CUDA neuron layout gives what the same layout gives on the CPU (whose int4 layer is tested
    against exact weights in test_ops); with float weights, what the neuron records give."""
    n_ff = 96
    store, _ = random_store(seed, ggml_type, n_ff, 64, 64, gated)
    ids = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n_ff - 1), min_size=1))), dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=generator)
    mask = torch.rand(1, len(ids), generator=generator) < 0.5 if masked else None
    activation = FFNActivation.RELU_GATED if gated else FFNActivation.RELU
    chooser = AboveThreshold(0.25) if oracle else None
    expected = KernelNeurons(store, ids, CPU).ffn(x, activation, mask, chooser)
    on_cuda = KernelNeurons(store, ids, CUDA)
    got = on_cuda.ffn(x.to(CUDA), activation, None if mask is None else mask.to(CUDA), chooser)
    assert on_cuda.nbytes == KernelNeurons(store, ids, CPU).nbytes
    assert_close_relative(got, expected, 2e-2 if ggml_type != T.F32 else 1e-4)
    if ggml_type == T.F32:
        assert_close_relative(got, RecordNeurons(store, ids, CPU).ffn(x, activation, mask, chooser), 1e-4)


@pytest.fixture(scope="module")
def relu_model(tiny_relu) -> Path:
    """A tiny ReLU llama in Q4_0 with the default model's vocabulary, alone in its folder."""
    return tiny_relu("q4_0")


# 21 KB: the last block only; 2 MB: the output head, both blocks and a few neurons; None: everything
@pytest.mark.parametrize("budget_gib", [20e-6, 0.0019, None])
@pytest.mark.parametrize("mode", ["oracle", "off"])
def test_hybrid_model_on_cuda_gives_the_cpu_result(relu_model, budget_gib, mode):
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    cpu = LLM(relu_model, n_ctx=N_CTX, sparsity=mode)
    everything = budget_gib is None
    if everything:  # an index with every neuron (with uniform statistics the solver would place none)
        budget_gib = place_everything(relu_model, "cuda")
    gpu = LLM(relu_model, n_ctx=N_CTX, sparsity=mode, vram_budget=budget_gib, accelerator="cuda",
              gpu_index="reuse" if everything else "reset")
    assert gpu.placement is not None and gpu.placement.device.type == "cuda"
    offloaded = [b.device.type == "cuda" for b in gpu.model.blocks]
    assert any(offloaded) and offloaded == sorted(offloaded)  # the last blocks go first
    if everything:
        assert all(isinstance(b.ffn, HybridFFN) and len(b.ffn.cold) == 0 for b in gpu.model.blocks)
        assert gpu.model.output_device.type == "cuda"
    # The CPU model's projections run our quant kernels, the GPU's torch's int4 one: each rounds inputs
    # and outputs to bfloat16 its own way (H100, 2026-11-27: the worst logit of a million 5.07 % of the
    # largest off, at a 2 MB budget)
    for got, expected in zip(decode_and_prefill_logits(gpu.model, ids), decode_and_prefill_logits(cpu.model, ids)):
        assert_close_relative(got, expected, 0.06)
