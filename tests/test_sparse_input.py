"""Input-sparse linears on column records (powerinfer/sparse/columns.py, ops/csrc/sparse_input.h)
against a masked dense product of the columns as the gguf package dequantizes them.

Errors allowed: float32 rounding of the products and sums (`float32_bound`), and on the AVX2 path
(which AVX-512 CPUs run too) for Q4_0 and Q4_1 the rounding of each batch's coefficients x_i d_i
to int8 per block (`coefficient_rounding_bound`), as the dense AVX2 kernel rounds x to int8."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants

from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import native
from powerinfer.ops.quant import T
from powerinfer.sparse import columns
from powerinfer.sparse.columns import SPARSE_MAX_ROWS, ColumnMatrix, column_linear, sparse_reference, transpose_quantize

pytestmark = pytest.mark.skipif(native.load() is None, reason="native operators unavailable")

TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K]
ALL_ISAS = ["avx512", "avx2", "scalar"]
# per type rounding its coefficients on the SIMD paths: the largest |q - offset| of its weights
INT8_COEFFICIENTS = {T.Q4_0: 8, T.Q4_1: 8}  # both multiply q - 8 (sparse_input.h)


@pytest.fixture(params=ALL_ISAS)
def each_isa(request):
    """Every instruction set; one this CPU lacks is skipped (only there)."""
    if request.param not in native.instruction_sets():
        pytest.skip(f"this CPU does not run {request.param}")
    with native.instruction_set(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def two_threads():
    """The kernels split outputs over threads: run them with more than one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Gaussian weights with 1 % outliers, as trained matrices have."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.02
    return torch.where(torch.rand(w.shape, generator=g) < 0.01, w * 8, w)


def outputs_for(ggml_type: T, blocks: int) -> int:
    return GGML_QUANT_SIZES[ggml_type][0] * blocks


def gguf_columns(m: ColumnMatrix) -> torch.Tensor:
    """W.T [in, out] as the gguf package dequantizes the records (float64)."""
    return torch.from_numpy(quants.dequantize(m.rows.numpy(), m.ggml_type).astype(np.float64))


def masked_product(matrices, thresholds: torch.Tensor, x: torch.Tensor, mask: bool = True,
                   rounds: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(the product in float64, the error allowed): x masked to |x| > thresholds, times W.T;
    `rounds`: with the SIMD paths' coefficient rounding."""
    wt = torch.cat([gguf_columns(m) for m in matrices], dim=1)
    xd = x.double()
    if mask:
        xd = torch.where(xd.abs() > thresholds.double(), xd, torch.zeros_like(xd))
    bound = float32_bound(xd, wt)
    if rounds:
        bound = bound + torch.cat([coefficient_rounding_bound(m, xd) for m in matrices], dim=1)
    return xd @ wt, bound


def coefficient_rounding_bound(m: ColumnMatrix, x: torch.Tensor) -> torch.Tensor:
    """Per row and output: in each group of channels (SPARSE_COLUMN_BATCH consecutive ones), a row's
    active channels (its non-zero x) round x_j d_j per block to a multiple of s = max_j |x_j d_j| / 127,
    off by s / 2 at most, each times |q - 8| <= 8 (0 for types the kernels do not round)."""
    bound = torch.zeros(x.shape[0], m.out_features, dtype=torch.float64)
    if m.ggml_type not in INT8_COEFFICIENTS:
        return bound
    block, size = GGML_QUANT_SIZES[m.ggml_type]
    d = torch.from_numpy(m.rows.numpy().reshape(m.in_features, -1, size)[..., :2].copy().view(np.float16)[..., 0]).double()
    group = native.load().SPARSE_COLUMN_BATCH
    for row in range(x.shape[0]):
        for first in range(0, x.shape[1], group):
            coefficients = x[row, first : first + group, None] * d[first : first + group]
            active = int((x[row, first : first + group] != 0).sum())
            step = coefficients.abs().amax(dim=0) / 127  # per block
            bound[row] += (active * step / 2 * INT8_COEFFICIENTS[m.ggml_type]).repeat_interleave(block)
    return bound


def float32_bound(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """Rounding of float32 sums of n products, each rounded a few times: (n + 8) eps sum |x w|."""
    eps = torch.finfo(torch.float32).eps
    return (wt.shape[0] + 8) * eps * (x.abs() @ wt.abs()) + 1e-30


def inputs(rows: int, in_features: int, seed: int) -> torch.Tensor:
    """Activations with a few exact zeros and heavy tails (as after a norm)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=g) * torch.rand(rows, in_features, generator=g) * 3
    x[torch.rand(x.shape, generator=g) < 0.05] = 0.0
    return x


def thresholds_at(x: torch.Tensor, sparsity: float, seed: int) -> torch.Tensor:
    """Per channel thresholds near the |x| quantile `sparsity`, varied per channel (as WINA's are)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.quantile(x.abs().flatten(), sparsity)
    return base * (0.5 + torch.rand(x.shape[1], generator=g))


def check(layer, matrices, thresholds, x, mask=True):
    got = layer(x)
    rounds = layer.projection is not None and native.load().isa() != "scalar" and x.shape[0] <= SPARSE_MAX_ROWS
    expected, bound = masked_product(matrices, thresholds, x, mask, rounds)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    worst = ((got.double() - expected).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} times the float32 bound"
    return got


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("in_features", [1, 37, 131])  # off the groups of 16 channels
def test_one_row_equals_the_masked_product_on_each_instruction_set(ggml_type, in_features, each_isa):
    blocks = 5 if ggml_type in (T.Q4_K, T.Q6_K) else 37  # two threads split the outputs inside a block
    m = transpose_quantize(weight(outputs_for(ggml_type, blocks), in_features, seed=in_features), ggml_type)
    x = inputs(1, in_features, seed=1)
    thresholds = thresholds_at(x, 0.5, seed=2)
    layer = column_linear([m], thresholds)
    check(layer, [m], thresholds, x)
    assert layer.last_selected == int((x.abs() > thresholds).sum())


def fused(seed: int, in_features: int = 200) -> list[ColumnMatrix]:
    """A fused projection of several block types side by side (as a Q4_K_M file's q, k, v are)."""
    shapes = [(T.Q4_K, 512), (T.Q6_K, 256), (T.Q4_0, 96), (T.Q8_0, 64), (T.Q4_1, 1056)]
    return [transpose_quantize(weight(out, in_features, seed + i), t) for i, (t, out) in enumerate(shapes)]


def test_fused_parts_of_mixed_types_equal_the_masked_product(each_isa):
    matrices = fused(seed=3)
    x = inputs(3, 200, seed=4)
    thresholds = thresholds_at(x, 0.4, seed=5)
    check(column_linear(matrices, thresholds), matrices, thresholds, x)


def test_each_row_gets_its_one_row_result_exactly(each_isa):
    """What keeps batched decoding equal to decoding alone: the rows' selections differ, their
    union is read once (the weights unpacked once for up to 4 rows), and each row's bits do not
    depend on the others."""
    matrices = fused(seed=6)
    x = inputs(SPARSE_MAX_ROWS, 200, seed=7)
    x[1] *= 4  # a row that selects many more channels than the others
    thresholds = thresholds_at(x, 0.6, seed=8)
    layer = column_linear(matrices, thresholds)
    assert layer.native is layer.projection is not None  # what the C++ decode step calls
    together = check(layer, matrices, thresholds, x)
    assert layer.last_selected == int((x.abs() > thresholds).sum())
    for rows in (slice(row, row + 1) for row in range(SPARSE_MAX_ROWS)):
        assert torch.equal(layer(x[rows]), together[rows])
    assert torch.equal(layer(x[2:5]), together[2:5])


def test_threads_do_not_change_a_rows_bits(each_isa):
    matrices = fused(seed=9)
    x = inputs(2, 200, seed=10)
    layer = column_linear(matrices, thresholds_at(x, 0.5, seed=11))
    two = layer(x)
    torch.set_num_threads(1)
    assert torch.equal(layer(x), two)


@pytest.mark.parametrize("rows", [1, 5])
def test_threshold_zero_equals_the_dense_product(rows, each_isa):
    matrices = fused(seed=12)
    x = inputs(rows, 200, seed=13)
    layer = column_linear(matrices, torch.zeros(200))
    check(layer, matrices, torch.zeros(200), x, mask=False)
    assert layer.last_selected == int((x != 0).sum())  # only exact zeros skipped


@pytest.mark.parametrize("rows", [SPARSE_MAX_ROWS + 1, 70])
def test_many_rows_select_as_one_row_does(rows, each_isa):
    """Prefill reads every column but keeps each row's selection: a row's result is its one-row
    result up to float32 rounding, however the rows are batched."""
    matrices = fused(seed=14)
    x = inputs(rows, 200, seed=15)
    thresholds = thresholds_at(x, 0.5, seed=16)
    layer = column_linear(matrices, thresholds)
    check(layer, matrices, thresholds, x)
    assert layer.last_selected == int((x.abs() > thresholds).sum())


def test_gguf_tensors_build_the_same_layer():
    """From a file's transposed tensors (mapped bytes, torch shape [in, out]) as from ColumnMatrix."""
    matrices = fused(seed=17)
    tensors = [GGUFTensor(f"t{i}", m.ggml_type, (200, m.out_features), m.rows.numpy()) for i, m in enumerate(matrices)]
    x = inputs(2, 200, seed=18)
    thresholds = thresholds_at(x, 0.5, seed=19)
    assert torch.equal(column_linear(tensors, thresholds)(x), column_linear(matrices, thresholds)(x))


def test_without_the_native_module_the_torch_reference_runs(monkeypatch):
    matrices = fused(seed=20)
    x = inputs(3, 200, seed=21)
    thresholds = thresholds_at(x, 0.5, seed=22)
    monkeypatch.setattr(columns.native, "load", lambda: None)
    layer = column_linear(matrices, thresholds)
    assert layer.projection is None and layer.last_selected is None
    reference = layer(x)
    assert torch.allclose(reference, sparse_reference(matrices, thresholds, x))
    check(layer, matrices, thresholds, x)


def test_bad_shapes_are_refused():
    m = transpose_quantize(weight(64, 40, seed=23), T.Q4_0)
    with pytest.raises(ValueError, match="one threshold per input channel"):
        column_linear([m], torch.zeros(41))
    with pytest.raises(ValueError, match="share their inputs"):
        column_linear([m, transpose_quantize(weight(64, 41, seed=24), T.Q4_0)], torch.zeros(40))
    with pytest.raises(ValueError, match="blocks of Q4_K"):
        transpose_quantize(weight(96, 40, seed=25), T.Q4_K)
    layer = column_linear([m], torch.zeros(40))
    with pytest.raises(RuntimeError, match="x must be"):
        layer(torch.zeros(1, 39))
