"""Feed-forward blocks: dense, or computed from the neurons that fire.

Both expose `activations(h)` (every neuron's activation) and `project(a)` (the down projection),
which the profiler and predictor training observe, and `__call__(h, residual)`; `residual` is the
block input before the FFN norm, the predictor's input (as in PowerInfer). Each keeps the file
tensors it was built from (`FFNTensors`), so that placement can rebuild it in the other form: a
neuron store for a layer split between devices, dense for a layer offloaded whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import quants

from powerinfer.config import FFNActivation
from powerinfer.errors import PowerInferError, UnsupportedModelError
from powerinfer.gguf.reader import GGUFFile, GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.linear import (
    BiasedLinear,
    DenseLinear,
    Linear,
    QuantLinear,
    build_linear,
    dequantized,
    float_vector,
)
from powerinfer.ops.quant import FLOAT_TYPES, T
from powerinfer.options import FFNOptions, SparsityMode
from powerinfer.sparse.neurons import NeuronStore, accumulate_rows, activate, neuron_activations, sparse_ffn
from powerinfer.sparse.predictor import has_predictors, load_predictor, predictor_pays
from powerinfer.sparse.select import AboveThreshold, AllNeurons, Predicted, Selector
from powerinfer.sparse.storage import projection_builder

MAX_SPARSE_ROWS = 8  # beyond this many tokens at once (prefill) the FFN runs as masked dense GEMMs
DENSE_SLICE = 2048  # neurons whose weights those GEMMs expand at a time
ACTIVATION_THRESHOLDS_KEY = "powerinfer.activation_thresholds"  # ours: calibrated |a| thresholds per FFN unit


@dataclass(frozen=True)
class FFNTensors:
    """One FFN's weights in the file: `down` is ffn_down [n_embd, n_ff], or, in a PowerInfer GGUF,
    ffn_down_t [n_ff, n_embd] (`transposed`). Biases (OPT) as float32. `expert`: which expert of
    block `layer`'s mixture of experts these are (None: the block's one FFN)."""

    layer: int
    activation: FFNActivation
    gate: GGUFTensor | None
    up: GGUFTensor
    down: GGUFTensor
    transposed: bool
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    expert: int | None = None

    @classmethod
    def read(cls, gguf: GGUFFile, layer: int, activation: FFNActivation) -> FFNTensors:
        name = lambda part, kind="weight": f"blk.{layer}.{part}.{kind}"  # noqa: E731
        if name("ffn_gate", "bias") in gguf.tensors:
            raise UnsupportedModelError(f"{gguf.path}: FFN gate biases are not supported")
        transposed = name("ffn_down_t") in gguf.tensors
        up, gate = gguf.tensor(name("ffn_up")), None
        if activation.is_gated:
            # without ffn_gate, ffn_up holds the gate rows then the up rows (Phi-3's gate_up_proj)
            gate, up = (gguf.tensor(name("ffn_gate")), up) if name("ffn_gate") in gguf.tensors else halves(up)
        return cls(layer, activation, gate, up, gguf.tensor(name("ffn_down_t" if transposed else "ffn_down")), transposed,
                   # PowerInfer names OPT's down bias after the tensor it goes with: ffn_down_t.bias in its files
                   _bias(gguf, name("ffn_up", "bias")), _bias(gguf, name("ffn_down", "bias"), name("ffn_down_t", "bias")))

    @classmethod
    def read_expert(cls, gguf: GGUFFile, layer: int, expert: int, activation: FFNActivation) -> FFNTensors:
        """Expert `expert` of block `layer`: its matrices in the stacked ffn_gate_exps, ffn_up_exps and
        ffn_down_exps [n_expert, rows, cols] (llama.cpp's layout)."""
        part = lambda name: expert_matrix(gguf.tensor(f"blk.{layer}.{name}_exps.weight"), expert)  # noqa: E731
        return cls(layer, activation, part("ffn_gate") if activation.is_gated else None, part("ffn_up"),
                   part("ffn_down"), False, None, None, expert)

    @property
    def n_ff(self) -> int:
        return self.up.shape[0]

    @property
    def n_embd(self) -> int:
        return self.down.shape[1] if self.transposed else self.down.shape[0]

    def dense(self, float32: bool = False) -> DenseFFN:
        up = build_linear([self.gate, self.up] if self.gate is not None else [self.up], float32)
        if self.up_bias is not None:
            n_gate = 0 if self.gate is None else self.gate.shape[0]
            up = BiasedLinear(up, torch.cat([torch.zeros(n_gate), self.up_bias]))
        # a PowerInfer file's down projection is stored transposed: its dense form is the transpose
        down = DenseLinear(dequantized(self.down).T.contiguous()) if self.transposed else build_linear([self.down], float32)
        if self.down_bias is not None:
            down = BiasedLinear(down, self.down_bias)
        return DenseFFN(up, down, self.activation, self)

    def neuron_store(self) -> NeuronStore:
        return NeuronStore(self.gate, self.up, self.down_rows(), self.up_bias, self.down_bias)

    def down_rows(self) -> GGUFTensor | torch.Tensor:
        """The down projection as one row per neuron: ffn_down_t as stored, else ffn_down transposed,
        kept in float32 for float files and re-encoded as Q8_0 otherwise (the file's blocks run along
        the other axis)."""
        if self.transposed:
            return self.down
        rows = dequantized(self.down).T.contiguous()
        if self.down_rows_type == T.F32:
            return rows
        name = self.down.name.replace("ffn_down", "ffn_down_t")
        return GGUFTensor(name, self.down_rows_type, tuple(rows.shape), quants.quantize(rows.numpy(), self.down_rows_type))

    @property
    def down_rows_type(self) -> T:
        """The type of `down_rows()`."""
        if self.transposed:
            return self.down.ggml_type
        return T.F32 if self.down.ggml_type in FLOAT_TYPES else T.Q8_0


def halves(tensor: GGUFTensor) -> tuple[GGUFTensor, GGUFTensor]:
    """The first and second half of a matrix's rows, as tensors of their own (views of the file)."""
    n = tensor.shape[0] // 2
    return tensor.rows(0, n), tensor.rows(n, 2 * n)


def expert_matrix(tensor: GGUFTensor, expert: int) -> GGUFTensor:
    """Matrix `expert` of a stacked [n_expert, rows, cols] tensor, as a tensor of its own (a view)."""
    return GGUFTensor(f"{tensor.name}[{expert}]", tensor.ggml_type, tensor.shape[1:], tensor.data[expert])


def _bias(gguf: GGUFFile, *names: str) -> torch.Tensor | None:
    """The first of the bias tensors `names` that the file has, as float32."""
    tensor = next((gguf.tensors[n] for n in names if n in gguf.tensors), None)
    return None if tensor is None else float_vector(tensor)


class FFN:
    """What dense and sparse FFNs share: showing their activations to an observer, and the forms
    placement swaps between (`dense()`, `sparse()`)."""

    n_ff: int
    mode: SparsityMode = "off"  # how it chooses neurons: a dense FFN computes them all
    # The C++ (up, down) projections the native decode step runs this FFN with, fused into the
    # block; None: the step hands the FFN its input and adds what it returns.
    native_projections: tuple | None = None

    def observed(self, h: torch.Tensor, residual: torch.Tensor, observer, unit: int) -> torch.Tensor:
        """The output for h, the activations shown to observer(unit, residual, activations) on the way."""
        a = self.activations(h)
        observer(unit, residual, a)
        return self.project(a)


class DenseFFN(FFN):
    """The feed-forward block computed for every neuron."""

    def __init__(self, up: Linear, down: Linear, activation: FFNActivation, tensors: FFNTensors | None):
        # `up` holds [gate; up] stacked for gated activations, `up` alone otherwise. `tensors`: None
        # for a `sparsify` output's FFN (whose linears are not rebuilt elsewhere).
        self.up, self.down, self.activation, self.tensors = up, down, activation, tensors
        self.n_ff = down.in_features

    def activations(self, h: torch.Tensor) -> torch.Tensor:
        return activate(self.up(h), self.activation)

    def project(self, a: torch.Tensor) -> torch.Tensor:
        return self.down(a)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.down(self.activations(h))

    def to(self, device: torch.device) -> DenseFFN:
        return DenseFFN(self.up.to(device), self.down.to(device), self.activation, self.tensors)

    def sparse(self) -> SparseFFN:
        """This FFN over neuron records, computing every neuron (mode "off")."""
        return SparseFFN(self.tensors.neuron_store(), self.activation, AllNeurons(), self.tensors)

    def dense(self) -> DenseFFN:
        return self

    @property
    def native_projections(self) -> tuple:
        return self.up.native, self.down.native

    @property
    def nbytes(self) -> int:
        return self.up.nbytes + self.down.nbytes


class SparseFFN(FFN):
    """An FFN over per-neuron records that computes only the neurons its `selector` chooses per row
    (select.py: all, those above an activation threshold, or the predictor's)."""

    def __init__(self, store: NeuronStore, activation: FFNActivation, selector: Selector,
                 tensors: FFNTensors | None = None):
        self.store, self.activation, self.selector, self.tensors = store, activation, selector, tensors
        self._all = torch.arange(store.n_ff)
        self.n_ff = store.n_ff
        self.last_active = store.n_ff  # neurons computed in the last call (for statistics)
        self._predicted = predicted_ffn(self)

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
            return torch.cat([self.dense_activations(h, neurons) for neurons in _slices(self.n_ff)], dim=-1)
        return neuron_activations(s, self.activation, h, self._all)

    def dense_activations(self, h: torch.Tensor, neurons: torch.Tensor | slice) -> torch.Tensor:
        """The activations of `neurons` for many rows h, as dense GEMMs."""
        s = self.store
        up = s.add_up_bias(self._dense(h, self._weights(s.up, neurons).T), neurons)
        if s.gate is not None:
            up = torch.cat([self._dense(h, self._weights(s.gate, neurons).T), up], dim=-1)
        return activate(up, self.activation)

    def project(self, a: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN output from the activations `a` of neurons `idx` (all when None)."""
        s = self.store
        if a.shape[0] > MAX_SPARSE_ROWS:
            y = torch.zeros(a.shape[0], s.dim_out)
            for part in _slices(a.shape[1]):
                y.add_(self._dense(a[:, part], self._weights(s.down, part if idx is None else idx[part])))
            return s.add_down_bias(y)
        return s.add_down_bias(accumulate_rows(s, s.down, a, self._all if idx is None else idx))

    def sparse(self) -> SparseFFN:
        return self

    def dense(self) -> DenseFFN:
        """This FFN computed for every neuron, from the file's tensors."""
        return self.tensors.dense()

    @property
    def mode(self) -> SparsityMode:
        return self.selector.mode

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        residual = h if residual is None else residual
        if h.shape[0] > MAX_SPARSE_ROWS:
            # Many rows (prefill, perplexity): dense GEMMs, with each row's skipped neurons zeroed,
            # which is what computing only the chosen neurons per token gives.
            a = self.activations(h)
            fired = self.selector.fired(a, residual)
            return self.project(a if fired is None else a * fired)
        if self._predicted is not None and h.shape[0] == 1:  # one token: the same steps in one native call
            y, self.last_active = self._predicted(h, residual)
            return self.store.add_down_bias(y)
        a = self.activations(h) if self.selector.from_activations else None
        fired = self.selector.fired(a, residual)
        if fired is None:
            self.last_active = self.store.n_ff
            return self.store.add_down_bias(sparse_ffn(self.store, self.activation, h, self._all))
        idx = union(fired)  # read once for all rows; each row keeps its own choice
        self.last_active = len(idx)
        if a is not None:
            return self.project((a * fired)[:, idx], idx)
        return self.store.add_down_bias(sparse_ffn(self.store, self.activation, h, idx, fired[:, idx]))

    @property
    def nbytes(self) -> int:
        return self.store.nbytes + self.selector.nbytes


def predicted_ffn(ffn: SparseFFN):
    """The native object that runs `ffn`'s single-token call when its predictor chooses (predictor,
    choice of neurons, sparse operator), or None where the Python steps must run: no native build,
    a predictor off our quantized kernel (float files' bfloat16 predictors), up biases (OPT)."""
    ops, store, predictor = native.load(), ffn.store, ffn.selector.predictor
    if ops is None or predictor is None or store.up_bias is not None or \
            not all(isinstance(fc, QuantLinear) for fc in (predictor.fc1, predictor.fc2)):
        return None
    return ops.PredictedFFN(predictor.fc1.projection, predictor.fc2.projection, predictor.threshold, store.records,
                            [] if store.gate is None else store.gate.as_list(), store.up.as_list(), store.down.as_list(),
                            native.activation(ffn.activation))


def _slices(n: int) -> list[slice]:
    """[0, n) in slices of DENSE_SLICE neurons: many-row products expand weights to floats a slice
    at a time (a 7B-width layer's store is ~540 MB as float32)."""
    return [slice(start, min(start + DENSE_SLICE, n)) for start in range(0, n, DENSE_SLICE)]


def union(fired: torch.Tensor) -> torch.Tensor:
    """Sorted ids of the neurons any row of `fired` [rows, n] chose."""
    return torch.nonzero(fired.any(0) if fired.shape[0] > 1 else fired[0]).flatten()


# ---------------------------------------------------------------- building FFNs from a GGUF file

def _oracle_threshold(gguf: GGUFFile, unit: int, activation: FFNActivation, options: FFNOptions) -> float:
    if options.thresholds is not None:
        return float(options.thresholds[unit])
    calibrated = gguf.get(ACTIVATION_THRESHOLDS_KEY)
    if calibrated:
        return float(calibrated[unit])
    if activation.is_relu_family:
        return 0.0
    raise PowerInferError(f"{gguf.path}: oracle sparsity on a {activation.value} model needs calibrated thresholds "
                          "(run `powerinfer profile` and pass them, or convert with predictors)")


def input_sparse_ffn(gguf: GGUFFile, layer: int, activation: FFNActivation, options: FFNOptions) -> DenseFFN:
    """Block `layer`'s FFN in a `sparsify` output: dense in form, its linears whose sites have
    thresholds skipping their input's small channels (sparse/storage.py)."""
    linear = projection_builder(gguf, options)
    name = lambda part: f"blk.{layer}.{part}.weight"  # noqa: E731
    # without ffn_gate, ffn_up holds the gate rows then the up rows (Phi-3's gate_up_proj)
    has_gate = name("ffn_gate") in gguf.tensors
    up = linear(name("ffn_gate"), name("ffn_up")) if activation.is_gated and has_gate else linear(name("ffn_up"))
    return DenseFFN(up, linear(name("ffn_down")), activation, None)


def build_ffn(gguf: GGUFFile, tensors: FFNTensors, unit: int, options: FFNOptions) -> DenseFFN | SparseFFN:
    """The FFN made of `tensors`, FFN unit `unit` of the model (`ModelConfig.ffn_unit`): over neuron
    records when some neurons are to be skipped (or the file stores its down projection per neuron),
    dense otherwise."""
    activation = tensors.activation
    predicted = options.sparsity == "auto" and has_predictors(gguf) and predictor_pays(gguf, unit, activation.is_relu_family)
    if options.float32 or not (predicted or options.sparsity == "oracle" or tensors.transposed):
        return tensors.dense(options.float32)
    store = tensors.neuron_store()
    if options.sparsity == "oracle":
        threshold = _oracle_threshold(gguf, unit, activation, options)
        return SparseFFN(store, activation, AboveThreshold(threshold), tensors)
    if predicted:
        predictor = load_predictor(gguf, tensors.layer, tensors.expert, unit, shape=(store.dim_in, store.n_ff))
        return SparseFFN(store, activation, Predicted(predictor), tensors)
    return SparseFFN(store, activation, AllNeurons(), tensors)
