"""What placing neurons costs: the model's shapes and bytes, the machine's speeds.

Everything here is read from a GGUF file's tensor table (no weights are touched) or measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from powerinfer.config import ModelConfig
from powerinfer.gguf.reader import GGUFFile, GGUFTensor
from powerinfer.models.moe import ffn_unit_tensors
from powerinfer.ops.linear import device_linear_bytes
from powerinfer.ops.quant import FLOAT_TYPES
from powerinfer.runtime.kv_cache import ACCELERATOR_CACHE_DTYPE
from powerinfer.sparse.ffn import FFNTensors
from powerinfer.sparse.neurons import RECORD_ALIGN, record_row_bytes

GiB = 1 << 30
KV_BYTES_PER_VALUE = ACCELERATOR_CACHE_DTYPE.itemsize
# weights and biases stay with the CPU store; so do a mixture of experts' experts and router
FFN_NEURON_PARTS = ("ffn_gate", "ffn_up", "ffn_down", "ffn_down_t", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                    "ffn_gate_inp")
PREDICTOR_PARTS = ("fc1", "fc2")
ATTENTION_PROJECTIONS = (("attn_q", "attn_k", "attn_v"), ("attn_qkv",), ("attn_output",))  # one projection each


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
    """Per FFN unit (`ModelConfig.ffn_unit`): neurons and bytes of one neuron record (gate, up and down rows as the neuron
    store lays them out, which is also what the accelerator holds)."""

    n_ff: tuple[int, ...]
    neuron_bytes: tuple[int, ...]

    @property
    def n_layers(self) -> int:
        """FFN units: layers, or (layer, expert) pairs in a mixture of experts."""
        return len(self.n_ff)

    @property
    def ffn_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.n_ff, self.neuron_bytes))


def neuron_record_bytes(ffn: FFNTensors) -> int:
    """Bytes of one neuron's record in the neuron store: its gate, up and down rows, aligned."""
    rows = [(t.ggml_type, t.shape[1]) for t in ([ffn.gate, ffn.up] if ffn.gate is not None else [ffn.up])]
    rows.append((ffn.down_rows_type, ffn.n_embd))
    total = sum(record_row_bytes(ggml_type, n_values) for ggml_type, n_values in rows)
    return -(-total // RECORD_ALIGN) * RECORD_ALIGN


def neuron_kernel_bytes(ffn: FFNTensors) -> int:
    """Bytes of one neuron as a CUDA accelerator holds it (`runtime.hybrid.KernelNeurons`): its gate
    and up rows as projection rows (float rows as float32), its down row in float16 (float32 for
    float files)."""
    rows = [ffn.gate, ffn.up] if ffn.gate is not None else [ffn.up]
    float_down = ffn.down.ggml_type in FLOAT_TYPES
    return (sum(4 * t.shape[1] if t.ggml_type in FLOAT_TYPES else device_linear_bytes([t], n_rows=1) for t in rows)
            + ffn.n_embd * (4 if float_down else 2))


def dense_ffn_bytes(ffn: FFNTensors) -> int:
    """Bytes of an FFN as dense projections on an accelerator (`FFNTensors.dense`, moved whole by
    layer offload): gate and up stacked, and the down projection (from PowerInfer's transposed
    ffn_down_t: float32)."""
    up = device_linear_bytes([ffn.gate, ffn.up] if ffn.gate is not None else [ffn.up])
    return up + (ffn.down.n_elements * 4 if ffn.transposed else device_linear_bytes([ffn.down]))


def model_shape(gguf: GGUFFile, config: ModelConfig, accelerator: str = "cpu") -> ModelShape:
    """Neurons and bytes per neuron of each FFN unit (each layer's FFN, or each expert) as an
    accelerator of type `accelerator` holds them: CUDA in kernel layout, any other (the CPU standing
    in for one) as neuron-store records."""
    units = ffn_unit_tensors(gguf, config)
    bytes_of = neuron_kernel_bytes if accelerator == "cuda" else neuron_record_bytes
    return ModelShape(tuple(u.n_ff for u in units), tuple(bytes_of(u) for u in units))


@dataclass(frozen=True)
class DenseParts:
    """Bytes of what the accelerator holds before any neuron, as it holds them: per block its
    attention projections, norms, predictor and KV cache; and the output head (output matrix and
    its norm). The token embedding is a lookup and stays on the CPU."""

    layers: tuple[int, ...]
    output: int

    @property
    def total(self) -> int:
        return sum(self.layers) + self.output


def _vector_bytes(t: GGUFTensor) -> int:
    """Norm weights and biases are held as float32, predictor matrices as bfloat16."""
    return t.n_elements * (2 if t.name.split(".")[-2] in PREDICTOR_PARTS else 4)


def dense_parts(gguf: GGUFFile, config: ModelConfig, n_ctx: int, n_slots: int = 1) -> DenseParts:
    """What the accelerator holds per block before any neuron, with KV caches for `n_slots` sequences."""
    kv = 2 * n_slots * n_ctx * config.kv_dim * KV_BYTES_PER_VALUE
    layers = []
    for i in range(config.n_layers):
        prefix = f"blk.{i}."
        tensors = {t.name.removeprefix(prefix): t for t in gguf.tensors.values() if t.name.startswith(prefix)}
        projections = [[tensors.pop(f"{p}.weight") for p in group if f"{p}.weight" in tensors]
                       for group in ATTENTION_PROJECTIONS]
        rest = [t for name, t in tensors.items() if name.split(".")[0] not in FFN_NEURON_PARTS]
        layers.append(sum(device_linear_bytes(g) for g in projections if g) + sum(_vector_bytes(t) for t in rest) + kv)
    output = gguf.tensor("output.weight" if "output.weight" in gguf.tensors else "token_embd.weight")
    norms = [t for name, t in gguf.tensors.items() if name.startswith("output_norm.")]
    return DenseParts(tuple(layers), device_linear_bytes([output]) + sum(_vector_bytes(t) for t in norms))


def measure_cpu_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of a few sums over a buffer far larger than the caches."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.nbytes / best
