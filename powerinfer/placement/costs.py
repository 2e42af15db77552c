"""What placing neurons costs: the model's shapes and bytes, the machine's speeds.

Everything here is read from a GGUF file's tensor table (no weights are touched) or measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES

from powerinfer.config import ModelConfig
from powerinfer.gguf.reader import GGUFFile, GGUFTensor
from powerinfer.ops.neuron import RECORD_ALIGN
from powerinfer.ops.quant import FLOAT_TYPES, T

GiB = 1 << 30
KV_BYTES_PER_VALUE = 2  # the accelerator holds its KV cache in float16
FFN_PARTS = ("ffn_gate", "ffn_up", "ffn_down", "ffn_down_t")


@dataclass(frozen=True)
class Speeds:
    """Measured speeds the cost model needs. Defaults: CPU bandwidth as measured on the reference
    machine (DESIGN.md, 2 threads); a consumer GPU's bandwidth (RTX 4090 class, ~1 TB/s peak, less
    for scattered rows); and a per-layer round trip (launch + h to the device + result back +
    synchronise) of a few tens of microseconds on PCIe."""

    cpu_bandwidth: float = 24e9  # bytes/s
    accelerator_bandwidth: float = 700e9  # bytes/s
    sync_seconds: float = 30e-6  # per layer that uses the accelerator, per token


@dataclass(frozen=True)
class ModelShape:
    """Per layer: neurons and bytes of one neuron record (gate, up and down rows as the neuron
    store lays them out, which is also what the accelerator holds)."""

    n_ff: tuple[int, ...]
    neuron_bytes: tuple[int, ...]

    @property
    def n_layers(self) -> int:
        return len(self.n_ff)

    @property
    def ffn_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.n_ff, self.neuron_bytes))


def _row_bytes(ggml_type: T, n_values: int) -> int:
    """Bytes of one row in the neuron store: Q4_0/Q4_1/Q8_0 as stored, floats as float32, any
    other type re-encoded as Q8_0 (mirrors `ops.neuron._encoded_rows`)."""
    if ggml_type in FLOAT_TYPES:
        return 4 * n_values
    if ggml_type not in (T.Q4_0, T.Q4_1, T.Q8_0):
        ggml_type = T.Q8_0
    block, size = GGML_QUANT_SIZES[ggml_type]
    return n_values // block * size


def neuron_record_bytes(gguf: GGUFFile, layer: int, gated: bool) -> int:
    tensor = lambda part: gguf.tensors.get(f"blk.{layer}.{part}.weight")  # noqa: E731
    rows = [tensor("ffn_gate"), tensor("ffn_up")] if gated else [tensor("ffn_up")]
    total = sum(_row_bytes(t.ggml_type, t.shape[1]) for t in rows)
    down_t = tensor("ffn_down_t")
    if down_t is not None:
        total += _row_bytes(down_t.ggml_type, down_t.shape[1])
    else:  # ffn_down transposed: float32 for float files, else re-encoded as Q8_0 (`ffn.down_rows`)
        down = tensor("ffn_down")
        total += _row_bytes(T.F32 if down.ggml_type in FLOAT_TYPES else T.Q8_0, down.shape[0])
    return -(-total // RECORD_ALIGN) * RECORD_ALIGN


def model_shape(gguf: GGUFFile, config: ModelConfig) -> ModelShape:
    n_ff = tuple(gguf.tensor(f"blk.{i}.ffn_up.weight").shape[0] for i in range(config.n_layers))
    sizes = tuple(neuron_record_bytes(gguf, i, config.activation.is_gated) for i in range(config.n_layers))
    return ModelShape(n_ff, sizes)


def _is_ffn_neuron_tensor(t: GGUFTensor) -> bool:
    return any(t.name.endswith(f".{part}.weight") for part in FFN_PARTS)


@dataclass(frozen=True)
class DenseParts:
    """Bytes the accelerator must hold before any neuron: weights other than the FFN neurons
    (attention, norms, predictors, output matrix) and the KV cache for the context."""

    weights: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def dense_parts(gguf: GGUFFile, config: ModelConfig, n_ctx: int) -> DenseParts:
    """The token embedding is a lookup and stays on the CPU, unless it doubles as the output matrix."""
    tied = "output.weight" not in gguf.tensors
    weights = sum(t.n_bytes for t in gguf.tensors.values()
                  if not _is_ffn_neuron_tensor(t) and (t.name != "token_embd.weight" or tied))
    kv = 2 * config.n_layers * n_ctx * config.kv_dim * KV_BYTES_PER_VALUE
    return DenseParts(weights, kv)


def measure_cpu_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of a few sums over a buffer far larger than the caches."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.nbytes / best
