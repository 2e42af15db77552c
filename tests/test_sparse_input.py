"""Input-sparse linears on channel runs (powerinfer/sparse/columns.py, ops/csrc/sparse_input.h)
against a masked dense product of the rows as the gguf package dequantizes them.

The kernels round each row's active x to int8 per block of 32 inputs, on the block's largest active
|x| (as the dense kernels round x); `rounded` does that to the masked x, and the result must then
equal the product up to float32 rounding (`float32_bound`), and up to what the runs round
(`runs_bound`): Q4_0's scales to bytes on a step per 256 inputs, and Q4_K's scale products in float16
where it shares a part with other 4-bit types (alone it keeps its own scales; Q8_0 and Q6_K keep
theirs). Prefill (more than SPARSE_MAX_ROWS rows) goes through the dense row kernels, which round x
their own way (`dense_kernels_x_bound`), and is checked bit for bit against them too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from powerinfer.gguf.reader import GGUFTensor
from powerinfer.ops import linear, native
from powerinfer.ops.quant import T, random_blocks
from powerinfer.sparse import columns
from powerinfer.sparse.columns import SPARSE_MAX_ROWS, RowMatrix, column_linear, runs_take, sparse_reference

from helpers import plain_and_vnni_avx2

pytestmark = pytest.mark.skipif(native.load() is None, reason="native operators unavailable")

RUN_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K]
ALL_ISAS = ["avx512", "avx2", "scalar"]


@pytest.fixture(params=ALL_ISAS)
def each_isa(request):
    """Every instruction set; one this CPU lacks is skipped (only there)."""
    if request.param not in native.instruction_sets():
        pytest.skip(f"this CPU does not run {request.param}")
    with native.instruction_set(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def two_threads():
    """The kernels split the input blocks over threads: run them with more than one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def matrix(ggml_type: T, out_features: int, in_features: int, seed: int) -> RowMatrix:
    """Rows of random blocks (every bit pattern of the integers, Gaussian scales)."""
    raw = random_blocks(ggml_type, out_features, in_features, np.random.default_rng(seed))
    return RowMatrix(torch.from_numpy(raw), ggml_type, in_features)


def gguf_weight(m: RowMatrix) -> torch.Tensor:
    """W [out, in] as the gguf package dequantizes the rows (float64)."""
    return torch.from_numpy(quants.dequantize(m.rows.numpy(), m.ggml_type).astype(np.float64))


def rounded(x: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """x masked to |x| > thresholds, then each block of 32 rounded to int8 on its largest |x| / 127."""
    x = torch.where(x.abs() > thresholds, x, torch.zeros_like(x)).double()
    blocks = x.view(x.shape[0], -1, 32)
    scale = (blocks.abs().amax(dim=2, keepdim=True).float() / 127).double()
    k = torch.where(scale > 0, (blocks.float() * (1 / scale.float())).round().double(), torch.zeros_like(blocks))
    return (k * scale).view_as(x)


def float32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rounding of float32 sums of n products, each rounded a few times: (n + 8) eps sum |x w|."""
    eps = torch.finfo(torch.float32).eps
    return (w.shape[1] + 8) * eps * (x.abs() @ w.abs().T) + 1e-30


def q4_0_scales(m: RowMatrix) -> torch.Tensor:
    """A Q4_0 matrix's d per output and block of 32 inputs (float64 [out, blocks])."""
    blocks = m.rows.view(m.rows.shape[0], -1, 18)
    return blocks[:, :, :2].contiguous().view(torch.float16).squeeze(2).double()


def runs_bound(x: torch.Tensor, m: RowMatrix, w: torch.Tensor) -> torch.Tensor:
    """What the runs may round. Q4_0: each d to a multiple of its step D (largest |d| of its 256 inputs
    / 127, in float16: at most 2^-11 over), at most D / 2 off, times |q - 8| <= 8. Q4_K beside other
    4-bit types: d times sub-block scale (and dmin times minimum) in float16, 2^-11 relative. The others:
    nothing."""
    if m.ggml_type == T.Q4_0:
        d = q4_0_scales(m).abs()
        blocks = d.shape[1]
        padded = torch.nn.functional.pad(d, (0, -blocks % 8))
        step = padded.view(d.shape[0], -1, 8).amax(dim=2).repeat_interleave(8, dim=1)[:, :blocks] / 127
        per_input = (4 * (1 + 2.0**-10) * step).repeat_interleave(32, dim=1)
        return x.abs() @ per_input.T
    if m.ggml_type == T.Q4_K:
        return 2.0**-10 * (x.abs() @ w.abs().T)
    return torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)


def dense_kernels_x_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the dense row kernels' rounding of x may cost: to bfloat16 (AVX-512 and scalar, 2^-9
    relative) or to int8 per block of 32 (AVX2, half a step: the block's largest |x| / 254)."""
    blocks = x.abs().view(x.shape[0], -1, 32)
    half_step = (blocks.amax(dim=2, keepdim=True) / 254).expand_as(blocks).reshape(x.shape)
    return (x.abs() * 2.0**-9 + half_step) @ w.abs().T


def check(layer, matrices, thresholds, x, x_rounding="decode", exact_scales=False):
    """The layer's result against the masked product; exact_scales: the runs round no scale.
    x_rounding: "decode" (the runs' kernels: x to int8 per block, exactly as `rounded`), "prefill"
    (many rows: the dense kernels' rounding, within dense_kernels_x_bound) or "none"."""
    got = layer(x)
    masked = torch.where(x.abs() > thresholds, x, torch.zeros_like(x)).double()
    xr = rounded(x, thresholds) if x_rounding == "decode" else masked
    weights = [gguf_weight(m) for m in matrices]
    expected = xr @ torch.cat(weights).T
    bound = float32_bound(xr, torch.cat(weights))
    if x_rounding == "prefill":
        bound = bound + dense_kernels_x_bound(xr, torch.cat(weights))
    if not exact_scales:
        bound = bound + torch.cat([runs_bound(xr, m, w) for m, w in zip(matrices, weights)], dim=1)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    worst = ((got.double() - expected).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g} times the bound"
    return got


def x_rounding(rows: int) -> str:
    """How a call of this many rows rounds x (check's x_rounding)."""
    return "decode" if rows <= SPARSE_MAX_ROWS else "prefill"


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


@pytest.mark.parametrize("ggml_type", RUN_TYPES)
@pytest.mark.parametrize("out_features", [1, 37, 131, 8200])  # off the kernels' steps (64, 128) and chunk (8192)
def test_one_row_equals_the_masked_product_on_each_instruction_set(ggml_type, out_features, each_isa):
    in_features = 512 if ggml_type in (T.Q4_K, T.Q6_K) else 96 + 32 * (out_features % 5)
    m = matrix(ggml_type, out_features, in_features, seed=out_features)
    x = inputs(1, in_features, seed=1)
    thresholds = thresholds_at(x, 0.5, seed=2)
    layer = column_linear([m], thresholds)
    check(layer, [m], thresholds, x)
    assert layer.last_selected == int((x.abs() > thresholds).sum())


def fused(seed: int, in_features: int = 256) -> list[RowMatrix]:
    """A fused projection of the 4-bit types side by side (as a Q4_K_M file's q and k are)."""
    shapes = [(T.Q4_K, 200), (T.Q4_0, 96), (T.Q4_1, 300)]
    return [matrix(t, out, in_features, seed + i) for i, (t, out) in enumerate(shapes)]


def test_fused_parts_of_mixed_types_equal_the_masked_product(each_isa):
    matrices = fused(seed=3)
    x = inputs(3, 256, seed=4)
    thresholds = thresholds_at(x, 0.4, seed=5)
    check(column_linear(matrices, thresholds), matrices, thresholds, x)


@pytest.mark.parametrize("rows", [7, 11, SPARSE_MAX_ROWS])  # groups of 4 (AVX-512: 8) rows read each run once
@pytest.mark.parametrize("form", ["4-bit", "Q8_0", "Q6_K"])
# 768: three super-blocks, which groups take turns on (two threads split them mid-super-block)
@pytest.mark.parametrize("in_features", [256, 768])
def test_each_row_gets_its_one_row_result_exactly(rows, form, in_features, each_isa):
    """What keeps batched decoding equal to decoding alone: each row's bits do not depend on the
    other rows of its call."""
    matrices = fused(6, in_features) if form == "4-bit" else [matrix(T[form], 200, in_features, seed=6)]
    x = inputs(rows, in_features, seed=7)
    x[1] *= 4  # a row that selects many more channels than the others
    x[2, :128] = 0.0  # and one with nothing in the first blocks
    x[5, 256:512] = 0.0  # and one with nothing in a super-block
    thresholds = thresholds_at(x, 0.6, seed=8)
    layer = column_linear(matrices, thresholds)
    assert layer.native is layer.projection is not None  # what the C++ decode step calls
    together = check(layer, matrices, thresholds, x)
    assert layer.last_selected == int((x.abs() > thresholds).sum())
    for row in range(rows):
        assert torch.equal(layer(x[row:row + 1]), together[row:row + 1])


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K])
@pytest.mark.parametrize("rows", [2, 3, 4, 6, 8])  # the AVX-512 kernels take up to 8 rows at once
def test_rows_read_together_equal_the_masked_product(ggml_type, rows, each_isa):
    """Outputs past one chunk of the 4-bit kernel (8192) and off its steps."""
    in_features = 256 if ggml_type in (T.Q4_K, T.Q6_K) else 96
    m = matrix(ggml_type, 8200, in_features, seed=rows)
    x = inputs(rows, in_features, seed=rows + 1)
    thresholds = thresholds_at(x, 0.5, seed=rows + 2)
    check(column_linear([m], thresholds), [m], thresholds, x)


@pytest.mark.skipif(native.load() is None or not native.load().avx_vnni_detected(), reason="this CPU has no AVX-VNNI")
@pytest.mark.parametrize("ggml_type", [T.Q8_0])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_avx_vnni_gives_the_plain_avx2_q8_runs_results_bit_for_bit(ggml_type, rows):
    in_features = 256
    m = matrix(ggml_type, 8200, in_features, seed=rows)
    x = inputs(rows, in_features, seed=rows + 1)
    layer = column_linear([m], thresholds_at(x, 0.3, seed=rows + 2))
    plain, vnni = plain_and_vnni_avx2(layer, x)
    assert torch.equal(plain, vnni)


@pytest.mark.parametrize("rows", [1, 5])
def test_threshold_zero_equals_the_dense_product(rows, each_isa):
    matrices = fused(seed=12)
    x = inputs(rows, 256, seed=13)
    layer = column_linear(matrices, torch.zeros(256))
    check(layer, matrices, torch.zeros(256), x)
    assert layer.last_selected == int((x != 0).sum())  # only exact zeros skipped


@pytest.mark.parametrize("rows", [SPARSE_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("form", ["4-bit", "Q8_0"])
def test_many_rows_select_as_one_row_does(rows, form, each_isa):
    """Prefill of a narrow projection reads every channel but keeps each row's selection (its x not
    rounded)."""
    matrices = fused(seed=14) if form == "4-bit" else [matrix(T.Q8_0, 200, 256, seed=14)]
    x = inputs(rows, 256, seed=15)
    thresholds = thresholds_at(x, 0.5, seed=16)
    layer = column_linear(matrices, thresholds)
    check(layer, matrices, thresholds, x, x_rounding="prefill")
    assert layer.last_selected == int((x.abs() > thresholds).sum())


def q4_0_as_the_runs_hold_it(m: RowMatrix) -> RowMatrix:
    """Q4_0 rows with each d as the runs keep it: a signed byte times a float16 step D per 256 inputs
    (their largest |d| / 127), the product rounded to float16."""
    rows = m.rows.clone().view(m.out_features, -1, 18)
    d = rows[:, :, :2].contiguous().view(torch.float16).squeeze(2).float()
    padded = torch.nn.functional.pad(d.abs(), (0, -d.shape[1] % 8))
    step = (padded.view(d.shape[0], -1, 8).amax(dim=2) / 127).half().float().repeat_interleave(8, dim=1)[:, :d.shape[1]]
    units = torch.where(step > 0, (d / step).round().clamp(-127, 127), torch.zeros_like(d))
    rows[:, :, :2] = (step * units).half().view(torch.uint8).view(d.shape[0], d.shape[1], 2)
    return RowMatrix(rows.view(m.out_features, -1), T.Q4_0, m.in_features)


@pytest.mark.parametrize("types", [[T.Q4_1], [T.Q8_0], [T.Q4_0], [T.Q4_K, T.Q4_K, T.Q6_K]])
def test_prefill_is_the_dense_kernels_on_the_rows_bit_for_bit(types, each_isa):
    """Many rows go through the runs repacked into the dense kernels' layout: the result is the dense
    kernels' on the file's rows with each row's skipped channels set to 0, bit for bit (Q4_0: on rows
    with the runs' d), for outputs off the repacking's 64 and for parts side by side (a Q4_K_M
    file's q, k and v)."""
    matrices = [matrix(t, out, 512, seed=25 + i) for i, (t, out) in enumerate(zip(types, [200, 72, 72]))]
    x = inputs(SPARSE_MAX_ROWS + 9, 512, seed=26)
    thresholds = thresholds_at(x, 0.5, seed=27)
    layer = column_linear(matrices, thresholds)
    got = layer(x)
    assert layer.last_selected == int((x.abs() > thresholds).sum())
    rows = [q4_0_as_the_runs_hold_it(m) if m.ggml_type == T.Q4_0 else m for m in matrices]
    dense = linear.build_linear([GGUFTensor(f"w{i}", m.ggml_type, (m.out_features, 512), m.rows.numpy())
                                 for i, m in enumerate(rows)])
    assert isinstance(dense, linear.QuantLinear)
    assert torch.equal(got, dense(torch.where(x.abs() > thresholds, x, torch.zeros_like(x))))


def test_gguf_tensors_build_the_same_layer():
    """From a file's tensors (mapped bytes, torch shape [out, in]) as from RowMatrix."""
    matrices = fused(seed=17)
    tensors = [GGUFTensor(f"t{i}", m.ggml_type, (m.out_features, 256), m.rows.numpy()) for i, m in enumerate(matrices)]
    x = inputs(2, 256, seed=18)
    thresholds = thresholds_at(x, 0.5, seed=19)
    assert torch.equal(column_linear(tensors, thresholds)(x), column_linear(matrices, thresholds)(x))


def test_the_runs_are_the_only_copy():
    """Built, a layer keeps no rows; its runs take the rows' bytes plus the scales' padding at most."""
    matrices = fused(seed=26)
    layer = column_linear(matrices, torch.zeros(256))
    assert layer.matrices == []
    rows = sum(m.rows.numel() for m in matrices)
    assert rows <= layer.nbytes <= rows * 1.25  # beside Q4_0, Q4_K's 18 bytes per 32 as 20; 596 outputs padded to 640


def test_without_the_native_module_the_torch_reference_runs(monkeypatch):
    matrices = fused(seed=20)
    x = inputs(3, 256, seed=21)
    thresholds = thresholds_at(x, 0.5, seed=22)
    monkeypatch.setattr(columns.native, "load", lambda: None)
    layer = column_linear(matrices, thresholds)
    assert layer.projection is None and layer.last_selected is None
    assert torch.allclose(layer(x), sparse_reference(matrices, thresholds, x))
    check(layer, matrices, thresholds, x, x_rounding="none")


def test_types_without_runs_are_refused():
    """Q5_K (and the other types without a form) stay by rows, alone or beside types with one."""
    assert runs_take([T.Q4_0, T.Q4_K, T.Q4_1]) and runs_take([T.Q8_0]) and runs_take([T.Q4_K, T.Q6_K, T.Q8_0])
    assert not runs_take([T.Q5_K]) and not runs_take([T.Q4_0, T.Q5_K])
    with pytest.raises(ValueError, match="channel runs take"):
        column_linear([GGUFTensor("w", T.Q5_K, (64, 256), random_blocks(T.Q5_K, 64, 256, np.random.default_rng(0)))],
                      torch.zeros(256))
    with pytest.raises(ValueError, match="no channel-run form"):
        column_linear([matrix(T.Q4_0, 64, 256, 1), RowMatrix(torch.from_numpy(random_blocks(T.Q5_K, 64, 256, np.random.default_rng(2))), T.Q5_K, 256)],
                      torch.zeros(256))


@pytest.mark.parametrize("rows", [1, 3, 4, 9, SPARSE_MAX_ROWS + 3])
def test_parts_of_each_form_side_by_side_equal_the_masked_product(rows, each_isa):
    """A Q4_K_M file's qkv (Q4_K q and k, Q6_K v), and Q8_0 and Q6_K beside them: a Q4_K part, a Q6 one,
    a Q8 one and a Q6 one, one selection, with outputs off the kernels' steps in each; prefill too."""
    matrices = [matrix(T.Q4_K, 70, 256, seed=30), matrix(T.Q4_K, 60, 256, seed=31), matrix(T.Q6_K, 131, 256, seed=32),
                matrix(T.Q8_0, 50, 256, seed=33), matrix(T.Q6_K, 40, 256, seed=34)]
    x = inputs(rows, 256, seed=35)
    thresholds = thresholds_at(x, 0.5, seed=36)
    layer = column_linear(matrices, thresholds)
    check(layer, matrices, thresholds, x, x_rounding=x_rounding(rows))
    # per block of 32 inputs: Q4_K (130 outputs padded to 256) 18.5 bytes per 32 weights, with its
    # table; Q6 (131 to 256, then 40 to 128) 26 and 0.25 in its table; Q8 (50 to 128) 34
    assert layer.nbytes == 8 * (256 * 37 // 2 + 384 * 26 + 128 * 34) + 384 * 2


def test_bytes_read_are_the_active_blocks_scales_and_channels_runs():
    """A Q4_0 part (200 outputs padded to 256: per block 256 scale bytes, per channel a 128-byte run,
    per super-block a 512-byte table entry) and a Q8_0 one (100 to 128: 256 and 128 bytes, no table),
    one row: a block without an active channel is not read; every channel of a call of many rows
    (prefill) is."""
    matrices = [matrix(T.Q4_0, 200, 512, seed=50), matrix(T.Q8_0, 100, 512, seed=51)]
    x = torch.zeros(1, 512)
    x[0, [0, 5, 40, 300]] = 1.0  # blocks 0, 1, 9: super-blocks 0 and 1
    layer = column_linear(matrices, torch.full((512,), 0.5))
    layer(x)
    assert layer.last_selected == 4
    assert layer.last_bytes_read == 3 * (256 + 256) + 4 * (128 + 128) + 2 * 512
    layer(torch.ones(SPARSE_MAX_ROWS + 1, 512))
    assert layer.last_bytes_read == layer.nbytes


@pytest.mark.parametrize("rows", [1, 4, SPARSE_MAX_ROWS + 1])
def test_q4_0_scales_are_bytes_on_a_step_per_256_inputs(rows, each_isa):
    """Q4_0's d go to a signed byte per output and block on a float16 step per output and 256 inputs
    (the last super-block short: 352 inputs are 11 blocks, 2 steps): 1 + 16 bytes per block and 2 per
    step, within runs_bound of the file's weights (signs of d mixed, as random_blocks gives them)."""
    m = matrix(T.Q4_0, 200, 352, seed=47)
    assert (q4_0_scales(m) < 0).any() and (q4_0_scales(m) > 0).any()
    x = inputs(rows, 352, seed=48)
    thresholds = thresholds_at(x, 0.4, seed=49)
    layer = column_linear([m], thresholds)
    assert layer.nbytes == 256 * (11 * 17 + 2 * 2)
    check(layer, [m], thresholds, x, x_rounding=x_rounding(rows))


@pytest.mark.parametrize("rows", [1, 4, SPARSE_MAX_ROWS + 1])
def test_q4_k_keeps_its_scales(rows, each_isa):
    """Q4_K's runs keep its 4-bit q and its scales exactly: sc and mn as bytes per output and 32
    inputs, the float16 D and M per 256 inputs: 18.5 bytes per 32 weights. Decoding, groups of rows
    and prefill alike."""
    m = matrix(T.Q4_K, 200, 512, seed=40)
    x = inputs(rows, 512, seed=41)
    thresholds = thresholds_at(x, 0.4, seed=42)
    layer = column_linear([m], thresholds)
    assert layer.nbytes == 256 * 512 // 32 * 18.5
    check(layer, [m], thresholds, x, x_rounding=x_rounding(rows), exact_scales=True)


@pytest.mark.parametrize("rows", [1, 4, SPARSE_MAX_ROWS + 1])
def test_q6_k_keeps_its_bits_and_sums_its_extremes_exactly(rows, each_isa):
    """Q6_K's runs keep its 6-bit q, int8 scales and float16 d: 26.25 bytes per 32 weights. Every
    channel active with k = 127 and every q at 63 or 0 (w = 31 or -32 steps): a 16-input sub-block's
    k (q - 32) sums to 16 * 32 * 127, past int16 (the kernels sum a sub-block's leading channels in one
    set of sums while 32 times their |k| fits int16, the rest in another), and with each block's first
    k at 127 and the others at 80, the first set ends after twelve channels."""
    rows_bytes = np.zeros((130, 2, 210), np.uint8)  # 130 outputs, 512 inputs: two Q6_K blocks per row
    rows_bytes[::2, :, :192] = 0xFF  # ql and qh: q = 63 in the even outputs, 0 in the odd ones
    rows_bytes[:, :, 192:208] = np.arange(1, 17, dtype=np.int8).view(np.uint8)  # sc 1..16 per 16 inputs
    rows_bytes[:, :, 208:210] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    m = RowMatrix(torch.from_numpy(rows_bytes.reshape(130, 420)), T.Q6_K, 512)
    x = torch.ones(rows, 512)
    x[1:] *= -2.0  # rows of k = -127 too
    thresholds = torch.zeros(512)
    layer = column_linear([m], thresholds)
    assert layer.nbytes == 256 * 512 // 32 * 26 + 2 * 2 * 256
    check(layer, [m], thresholds, x, x_rounding=x_rounding(rows), exact_scales=True)
    x = torch.full((rows, 512), 80 / 127)
    x[:, ::32] = 1.0
    check(layer, [m], thresholds, x, x_rounding=x_rounding(rows), exact_scales=True)
    m = matrix(T.Q6_K, 200, 512, seed=43)
    x = inputs(rows, 512, seed=44)
    thresholds = thresholds_at(x, 0.4, seed=45)
    check(column_linear([m], thresholds), [m], thresholds, x, x_rounding=x_rounding(rows), exact_scales=True)


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_q6_k_rows_whose_sums_split_get_their_one_row_results(rows, each_isa):
    """A row whose k sum past int16's bound in its sub-blocks (every |x| near its block's largest)
    splits its group's Q6 sums in two rounds, where the rows beside it, alone, would take one. Each
    row's bits must still be its one-row result (batched decoding equals decoding alone)."""
    m = matrix(T.Q6_K, 200, 512, seed=6)
    x = inputs(rows, 512, seed=7)
    x[0] = torch.sign(x[0]) * (1.0 + 0.01 * torch.rand(512, generator=torch.Generator().manual_seed(8)))
    x[0, x[0] == 0] = 1.0
    layer = column_linear([m], torch.zeros(512))
    together = check(layer, [m], torch.zeros(512), x)
    for row in range(rows):
        assert torch.equal(layer(x[row:row + 1]), together[row:row + 1])


def test_bad_shapes_are_refused():
    m = matrix(T.Q4_0, 64, 64, seed=23)
    with pytest.raises(ValueError, match="one threshold per input channel"):
        column_linear([m], torch.zeros(65))
    with pytest.raises(ValueError, match="share their inputs"):
        column_linear([m, matrix(T.Q4_0, 64, 96, seed=24)], torch.zeros(64))
    layer = column_linear([m], torch.zeros(64))
    with pytest.raises(RuntimeError, match="x must be"):
        layer(torch.zeros(1, 63))


def test_a_large_matrix_is_regrouped_in_slices_dropping_pages_after_each(monkeypatch):
    """Given release_pages, a matrix goes in slices of rows (the file's pages dropped after each, so
    both copies are never whole at once); the runs are those of the matrix whole."""
    monkeypatch.setattr(linear, "REPACK_SLICE_BYTES", 5000)
    m = matrix(T.Q4_0, 300, 256, seed=21)  # 144 bytes a row: 34 rows a slice, 9 slices
    x = inputs(3, 256, seed=22)
    thresholds = thresholds_at(x, 0.5, seed=23)
    calls = []
    sliced = column_linear([m], thresholds, release_pages=lambda: calls.append(1))
    assert len(calls) == 9
    assert torch.equal(sliced(x), column_linear([m], thresholds)(x))


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K])
@pytest.mark.parametrize("rows", [1, 3])
def test_super_blocks_with_skipped_blocks_and_rows(ggml_type, rows, each_isa):
    """The forms with byte scales sum each super-block (256 inputs) in floats that its D multiplies
    once: super-blocks whose first blocks are skipped, one skipped whole (K types), a short last one
    (Q4_0), a row with nothing in a block where the other rows have something, and the two threads'
    split inside a super-block."""
    k_type = ggml_type != T.Q4_0
    in_features = 256 * 5 if k_type else 256 * 3 + 64  # 40 blocks split at 20, or 26 at 13
    m = matrix(ggml_type, 300, in_features, seed=rows)
    x = inputs(rows, in_features, seed=50 + rows)
    skipped = [0, 1, 9, 10, 11, 16, 17] + (list(range(24, 32)) if k_type else [])
    for block in skipped:
        x[:, 32 * block:32 * (block + 1)] = 0.0
    x[0, 32 * 8:32 * 9] = 0.0  # row 0 has nothing in super-block 1's first active block
    thresholds = thresholds_at(x, 0.3, seed=60)
    check(column_linear([m], thresholds), [m], thresholds, x)
