"""The placement cost model's byte counts against the objects they count: each figure in
powerinfer/placement/costs.py (derived from the layouts: ops.linear.int4_shapes, the neuron
records) equals the bytes actually allocated, for every weight type, so the model cannot drift
from build_linear and the neuron store."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from powerinfer.config import FFNActivation
from powerinfer.ops.linear import build_linear, device_linear_bytes
from powerinfer.placement.costs import neuron_record_bytes
from powerinfer.sparse.ffn import FFNTensors

from helpers import BLOCK_TYPES, random_tensor

CPU = torch.device("cpu")  # the CPU standing in for an accelerator: the layouts an accelerator holds
TYPES = [T.F32, T.F16, *BLOCK_TYPES]


def tensors(seed: int, ggml_type: T, rows: list[int], cols: int):
    rng = np.random.default_rng(seed)
    return [random_tensor(rng, n, cols, ggml_type)[0] for n in rows]


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("rows", [[40], [64, 24], [100]])  # not multiples of the packing tiles
def test_projection_bytes_are_what_build_linear_allocates(ggml_type, rows):
    weights = tensors(1, ggml_type, rows, 256)
    assert device_linear_bytes(weights) == build_linear(weights, device=CPU).nbytes


def test_mixed_type_projection_bytes():
    weights = tensors(2, T.Q4_K, [32], 256) + tensors(3, T.Q6_K, [32], 256) + tensors(4, T.Q8_0, [16], 256)
    assert device_linear_bytes(weights) == build_linear(weights, device=CPU).nbytes


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_neuron_record_bytes_are_what_the_store_allocates(ggml_type, transposed):
    n_ff, n_embd = 256, 256  # ffn_down [n_embd, n_ff] needs whole blocks along n_ff
    gate, up = tensors(5, ggml_type, [n_ff, n_ff], n_embd)
    down = tensors(6, ggml_type, [n_ff if transposed else n_embd], n_embd if transposed else n_ff)[0]
    ffn = FFNTensors(0, FFNActivation.RELU, gate, up, down, transposed, None, None)
    store = ffn.neuron_store()
    assert neuron_record_bytes(ffn) == store.record_bytes == store.records.nbytes // n_ff
