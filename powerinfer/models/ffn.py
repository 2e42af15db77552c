"""Feed-forward blocks: dense, or computed from the neurons that fire.

Both expose `activations(h)` (every neuron's activation) and `project(a)` (the down projection),
which the profiler and predictor training observe, and `__call__(h, residual)`; `residual` is the
block input before the FFN norm, the predictor's input (as in PowerInfer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from gguf import quants

from powerinfer.config import FFNActivation
from powerinfer.errors import PowerInferError, UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile, GGUFTensor
from powerinfer.ops.activation import activate
from powerinfer.ops.linear import CPU, BiasedLinear, DenseLinear, Linear, float_vector, mapped_tensor
from powerinfer.ops.neuron import NeuronStore, accumulate_rows, gather_matvec, sparse_ffn
from powerinfer.ops.quant import FLOAT_TYPES, T, dequantize_rows

if TYPE_CHECKING:
    from powerinfer.runtime.hybrid import HybridOptions

SparsityMode = Literal["auto", "off", "oracle"]
MAX_SPARSE_ROWS = 8  # beyond this many tokens at once (prefill) the FFN runs as masked dense GEMMs


class DenseFFN:
    """The feed-forward block computed for every neuron."""

    def __init__(self, up: Linear, down: Linear, activation: FFNActivation):
        # `up` holds [gate; up] stacked for gated activations, `up` alone otherwise.
        self.up, self.down, self.activation = up, down, activation

    def activations(self, h: torch.Tensor) -> torch.Tensor:
        return activate(self.up(h), self.activation)

    def project(self, a: torch.Tensor) -> torch.Tensor:
        return self.down(a)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down(activate(self.up(h), self.activation))

    @property
    def nbytes(self) -> int:
        return self.up.nbytes + self.down.nbytes


class Predictor:
    """PowerInfer's activation predictor: scores = fc2(relu(fc1(x))); a neuron is predicted to fire
    when its score is >= the threshold."""

    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor, threshold: float):
        # bfloat16: torch's fast CPU matmul for one row; the predictor reads as many bytes per
        # token as a good share of the neurons it saves.
        self.fc1, self.fc2 = fc1.to(torch.bfloat16).contiguous(), fc2.to(torch.bfloat16).contiguous()
        self.threshold = threshold

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x.to(torch.bfloat16), self.fc1)), self.fc2).float()

    def to(self, device: torch.device) -> "Predictor":
        return Predictor(self.fc1.to(device), self.fc2.to(device), self.threshold)

    def active(self, x: torch.Tensor) -> torch.Tensor:
        """Sorted ids of the neurons predicted to fire for any row of x."""
        fires = self.scores(x) >= self.threshold
        return torch.nonzero(fires.any(0) if fires.shape[0] > 1 else fires[0]).flatten()

    @property
    def nbytes(self) -> int:
        return self.fc1.nbytes + self.fc2.nbytes


class SparseFFN:
    """An FFN over per-neuron records that computes only the neurons that fire.

    mode "auto": neurons chosen by the predictor; "oracle": every activation is computed and the
    neurons whose |activation| <= threshold are skipped in the down projection (the exact result
    for ReLU-family models with threshold 0); "off": all neurons.
    """

    def __init__(self, store: NeuronStore, activation: FFNActivation, mode: SparsityMode,
                 predictor: Predictor | None = None, threshold: float = 0.0):
        if mode == "auto" and predictor is None:
            raise ValueError("sparsity 'auto' needs a predictor")
        self.store, self.activation, self.mode = store, activation, mode
        self.predictor, self.threshold = predictor, threshold
        self._all = torch.arange(store.n_ff)
        self.last_active = store.n_ff  # neurons computed in the last call (for statistics)

    @staticmethod
    def _dense(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x @ weights for many rows at once: bfloat16 GEMM for quantized weights, float32 for float
        files (exact where the file is)."""
        return x.float() @ weights if weights.dtype == torch.float32 else (x.to(weights.dtype) @ weights).float()

    def _weights(self, section, idx=None) -> torch.Tensor:
        weights = self.store.weights(section, idx)
        return weights if section.bits == 32 else weights.to(torch.bfloat16)

    def activations(self, h: torch.Tensor) -> torch.Tensor:
        s = self.store
        if h.shape[0] > MAX_SPARSE_ROWS:
            up = s.add_up_bias(self._dense(h, self._weights(s.up).T))
            if s.gate is not None:
                up = torch.cat([self._dense(h, self._weights(s.gate).T), up], dim=-1)
            return activate(up, self.activation)
        gate = None if s.gate is None else gather_matvec(s, s.gate, h, self._all)
        up = s.add_up_bias(gather_matvec(s, s.up, h, self._all))
        return activate(up if gate is None else torch.cat([gate, up], dim=-1), self.activation)

    def project(self, a: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN output from the activations `a` of neurons `idx` (all when None)."""
        s = self.store
        if a.shape[0] > MAX_SPARSE_ROWS:
            return s.add_down_bias(self._dense(a, self._weights(s.down, idx)))
        return s.add_down_bias(accumulate_rows(s, s.down, a, self._all if idx is None else idx))

    def fired(self, a: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Which neurons each row computes ([rows, n_ff] bool): the predictor's choice ("auto") or
        those whose |activation| exceeds the threshold ("oracle")."""
        if self.mode == "oracle":
            return a.abs() > self.threshold
        return self.predictor.scores(h if residual is None else residual) >= self.predictor.threshold

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if h.shape[0] > MAX_SPARSE_ROWS:
            # Many rows (prefill, perplexity): dense GEMMs, with each row's skipped neurons zeroed,
            # which is what computing only the chosen neurons per token gives.
            a = self.activations(h)
            if self.mode != "off":
                a = a * self.fired(a, h, residual)
            return self.project(a)
        if self.mode == "off":
            self.last_active = self.store.n_ff
            return self.store.add_down_bias(sparse_ffn(self.store, self.activation, h, self._all))
        if self.mode == "oracle":
            a = self.activations(h)
            fired = self.fired(a, h, residual)
            idx = torch.nonzero(fired.any(0) if fired.shape[0] > 1 else fired[0]).flatten()
            self.last_active = len(idx)
            return self.project((a * fired)[:, idx], idx)
        idx = self.predictor.active(h if residual is None else residual)
        self.last_active = len(idx)
        return self.store.add_down_bias(sparse_ffn(self.store, self.activation, h, idx))

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + (self.predictor.nbytes if self.predictor is not None else 0)


# ---------------------------------------------------------------- building FFNs from a GGUF file

@dataclass(frozen=True)
class FFNOptions:
    """How FFNs are built. `thresholds`: per-layer |activation| thresholds for oracle mode
    (default: the file's calibrated ones; 0 for ReLU-family models). `hybrid`: what runs on the
    accelerator (a layer with hot neurons or offloaded dense parts is always built sparse)."""

    sparsity: SparsityMode = "auto"
    float32: bool = False
    thresholds: tuple[float, ...] | None = None
    hybrid: HybridOptions | None = None


def offload_device(options: FFNOptions, layer: int | None) -> torch.device | None:
    """The accelerator that holds block `layer`'s dense parts (None: the output head's), or None
    when they stay on the CPU."""
    hybrid = options.hybrid
    return hybrid.device if hybrid is not None and hybrid.offloads(layer) else None


def dense_device(options: FFNOptions, layer: int | None) -> torch.device:
    """Where block `layer`'s dense parts (None: the output head's) live."""
    device = offload_device(options, layer)
    return CPU if device is None else device


ACTIVATION_THRESHOLDS_KEY = "powerinfer.activation_thresholds"  # ours: calibrated |a| thresholds per layer
LAYER_THRESHOLDS_KEY = "powerinfer.layer_sparse_thresholds"  # ours: predictor score thresholds per layer
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"  # PowerInfer's: one predictor score threshold


def has_predictors(gguf: GGUFFile) -> bool:
    return "blk.0.fc1.weight" in gguf.tensors


def _dequantized(tensor: GGUFTensor) -> torch.Tensor:
    return dequantize_rows(mapped_tensor(tensor.rows_as_bytes()), tensor.ggml_type, tensor.shape[1])


def down_rows(gguf: GGUFFile, layer: int) -> GGUFTensor | torch.Tensor:
    """The down projection as one row per neuron: ffn_down_t when the file has it (PowerInfer GGUF),
    else ffn_down transposed, kept in float32 for float files and re-encoded as Q8_0 otherwise (the
    file's blocks run along the other axis)."""
    stored = gguf.tensors.get(f"blk.{layer}.ffn_down_t.weight")
    if stored is not None:
        return stored
    down = gguf.tensor(f"blk.{layer}.ffn_down.weight")
    rows = _dequantized(down).T.contiguous()
    if down.ggml_type in FLOAT_TYPES:
        return rows
    return GGUFTensor(f"blk.{layer}.ffn_down_t.weight", T.Q8_0, tuple(rows.shape), quants.quantize(rows.numpy(), T.Q8_0))


def _predictor(gguf: GGUFFile, layer: int) -> Predictor:
    thresholds = gguf.get(LAYER_THRESHOLDS_KEY)
    threshold = float(thresholds[layer]) if thresholds else float(gguf.get(SPARSE_THRESHOLD_KEY, 0.0))
    return Predictor(_dequantized(gguf.tensor(f"blk.{layer}.fc1.weight")),
                     _dequantized(gguf.tensor(f"blk.{layer}.fc2.weight")), threshold)


def _oracle_threshold(gguf: GGUFFile, layer: int, activation: FFNActivation, options: FFNOptions) -> float:
    if options.thresholds is not None:
        return float(options.thresholds[layer])
    calibrated = gguf.get(ACTIVATION_THRESHOLDS_KEY)
    if calibrated:
        return float(calibrated[layer])
    if activation.is_relu_family:
        return 0.0
    raise PowerInferError(f"{gguf.path}: oracle sparsity on a {activation.value} model needs calibrated thresholds "
                          "(run `powerinfer profile` and pass them, or convert with predictors)")


def _bias(gguf: GGUFFile, *names: str) -> torch.Tensor | None:
    """The first of the bias tensors `names` that the file has, as float32."""
    tensor = next((gguf.tensors[n] for n in names if n in gguf.tensors), None)
    return None if tensor is None else float_vector(tensor)


def build_ffn(gguf: GGUFFile, layer: int, activation: FFNActivation, linear, options: FFNOptions):
    """The FFN of block `layer`; `linear(*names)` builds a dense projection (with its biases) from
    weight names."""
    name = lambda part, kind="weight": f"blk.{layer}.{part}.{kind}"  # noqa: E731
    if name("ffn_gate", "bias") in gguf.tensors:
        raise UnsupportedModelError(f"{gguf.path}: FFN gate biases are not supported")
    stored_down_t = name("ffn_down_t") in gguf.tensors
    # PowerInfer names OPT's down bias after the tensor it goes with: ffn_down_t.bias in its files
    down_bias = _bias(gguf, name("ffn_down", "bias"), name("ffn_down_t", "bias"))
    hybrid = options.hybrid is not None and options.hybrid.splits(layer)
    if options.float32 or (not hybrid and options.sparsity == "off" and not stored_down_t) or (
            not hybrid and options.sparsity == "auto" and not has_predictors(gguf) and not stored_down_t):
        up = [name("ffn_gate"), name("ffn_up")] if activation.is_gated else [name("ffn_up")]
        if stored_down_t:  # dense from a PowerInfer file: the down projection is the transpose
            down = DenseLinear(_dequantized(gguf.tensor(name("ffn_down_t"))).T.contiguous())
            down = down if down_bias is None else BiasedLinear(down, down_bias)
        else:
            down = linear(name("ffn_down"))
        return DenseFFN(linear(*up), down, activation)
    store = NeuronStore(gguf.tensor(name("ffn_gate")) if activation.is_gated else None, gguf.tensor(name("ffn_up")),
                        down_rows(gguf, layer), _bias(gguf, name("ffn_up", "bias")), down_bias)
    if options.sparsity == "oracle":
        ffn = SparseFFN(store, activation, "oracle", threshold=_oracle_threshold(gguf, layer, activation, options))
    elif options.sparsity == "auto" and has_predictors(gguf):
        ffn = SparseFFN(store, activation, "auto", predictor=_predictor(gguf, layer))
    else:
        ffn = SparseFFN(store, activation, "off")
    return options.hybrid.wrap(ffn, layer) if hybrid else ffn
