"""QuantLinear's native kernel (csrc/quant_matmul*): every GGML block type on every instruction set
this CPU has, against gguf.quants' dequantization times a float64 matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer.ops import native
from powerinfer.ops.linear import QuantLinear, pack_quant, quant_kernel
from powerinfer.ops.quant import BLOCK_TYPES
from powerinfer.sparse import neurons as N

from conftest import quantized_rows
from helpers import plain_and_vnni_avx2

pytestmark = pytest.mark.skipif(quant_kernel() is None, reason="native operators unavailable")
TYPES = sorted(BLOCK_TYPES)


def dequantized(tensor) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(tensor.data, tensor.ggml_type).astype(np.float64))


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What float32 sums may be off by: the kernels add x (128 + q) d sc per weight, so per weight
    up to ~256 times its sub-block's largest |w| (groups of 16 inputs), and then take the sums away."""
    group_max = w.abs().view(w.shape[0], -1, 16).amax(-1).repeat_interleave(16, dim=1)
    return 2 * w.shape[1] * 2.0**-24 * (x.double().abs() @ (256 * group_max).T) + 1e-30


def expected_product(x: torch.Tensor, tensor) -> torch.Tensor:
    """What the active kernel computes, in float64: the weights times x rounded to bfloat16
    (AVX-512's bfloat16 kernel, scalar) or to int8 per 32 inputs (the AVX2 kernels; quant_matmul.h)."""
    if native.activation_rounding() == "int8":
        q, scale, _ = N.quantize_activations(x)
        rounded = (q * scale[..., None]).view(x.shape).double()
    else:
        rounded = x.to(torch.bfloat16).double()
    return rounded @ dequantized(tensor).T


def test_native_block_types_are_ours():
    assert {T(t) for t in quant_kernel().quant_types()} == BLOCK_TYPES


@settings(max_examples=25, deadline=None)
@given(ggml_type=st.sampled_from(TYPES), rows=st.integers(1, 70), blocks=st.integers(1, 3), tokens=st.integers(1, 19),
       seed=st.integers(0, 2**16))
def test_every_type_on_every_instruction_set_equals_dequantized_matmul(ggml_type, rows, blocks, tokens, seed):
    """Rows not a multiple of the 16-output blocks, rows of x not a multiple of the 8 that share a pass."""
    cols = GGML_QUANT_SIZES[ggml_type][0] * blocks * (3 if ggml_type in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) else 1)
    tensor = quantized_rows(ggml_type, rows, cols, seed)
    layer = pack_quant([tensor])
    assert isinstance(layer, QuantLinear) and (layer.out_features, layer.in_features) == (rows, cols)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed))
    bound = rounding_bound(x, dequantized(tensor))
    for path in native.kernel_paths():
        with native.kernel_path(path):
            got = layer(x)
            expected = expected_product(x, tensor)
        assert got.dtype == torch.float32 and got.shape == (tokens, rows)
        assert torch.all((got.double() - expected).abs() <= bound), path


@pytest.mark.skipif(quant_kernel() is None or not quant_kernel().avx_vnni_detected(), reason="this CPU has no AVX-VNNI")
@settings(max_examples=20, deadline=None)
@given(ggml_type=st.sampled_from(TYPES), rows=st.integers(1, 40), tokens=st.integers(1, 11), seed=st.integers(0, 2**16))
def test_avx_vnni_gives_the_plain_avx2_kernels_results_bit_for_bit(ggml_type, rows, tokens, seed):
    """Both sum the same integer products exactly (vpdpbusd in int32, vpmaddubsw in int16 runs that cannot
    overflow), so the AVX2 path is one path whichever the CPU runs."""
    cols = 2 * GGML_QUANT_SIZES[ggml_type][0] if ggml_type not in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0) else 96
    layer = pack_quant([quantized_rows(ggml_type, rows, cols, seed)])
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed))
    plain, vnni = plain_and_vnni_avx2(layer, x)
    assert torch.equal(plain, vnni)


@pytest.mark.skipif(quant_kernel() is None or quant_kernel().detected_isa() != "avx512", reason="this CPU has no AVX-512")
@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_K, T.Q6_K, T.Q8_0])
def test_avx512_without_the_bfloat16_kernel_runs_the_avx2_kernels(ggml_type):
    """Where the bfloat16 dot product is off (Intel's CPUs by default), QuantLinear on AVX-512 gives the
    AVX2 integer kernels' results bit for bit, one row and several."""
    layer = pack_quant([quantized_rows(ggml_type, 50, 512, seed=7)])
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(8))
    with native.instruction_set("avx2"):
        avx2 = layer(x)
    with native.instruction_set("avx512"), native.bf16_dot(False):
        assert quant_kernel().quant_kernel_isa() == "avx2" and native.activation_rounding() == "int8"
        assert torch.equal(layer(x), avx2) and torch.equal(layer(x[:1]), avx2[:1])
    with native.instruction_set("avx512"), native.bf16_dot(True):
        assert quant_kernel().quant_kernel_isa() == "avx512" and not torch.equal(layer(x), avx2)


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.Q3_K])
def test_each_row_gets_its_single_row_result_exactly(ggml_type, isa):
    """What keeps batched decoding equal to decoding alone: rows do not affect each other."""
    layer = pack_quant([quantized_rows(ggml_type, 77, 512, seed=1)])
    x = torch.randn(19, 512, generator=torch.Generator().manual_seed(2))  # two passes of 8 rows, then 3
    together = layer(x)
    for row in range(19):
        assert torch.equal(together[row], layer(x[row : row + 1])[0])


def test_types_mixed_in_one_projection_as_q4_k_m_files_have(isa):
    """A fused projection whose tensors differ in type (Q4_K_M: attn_v in Q6_K) is one layer."""
    tensors = [quantized_rows(T.Q4_K, 40, 256, seed=3), quantized_rows(T.Q6_K, 24, 256, seed=4),
               quantized_rows(T.Q4_0, 9, 256, seed=5)]
    layer = pack_quant(tensors)
    x = torch.randn(3, 256)
    expected = torch.cat([expected_product(x, t) for t in tensors], dim=1)
    w = torch.cat([dequantized(t) for t in tensors])
    assert torch.all((layer(x).double() - expected).abs() <= rounding_bound(x, w))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_repacked_weights_are_about_the_file_size(ggml_type):
    tensor = quantized_rows(ggml_type, 64, 512, seed=6)
    assert tensor.data.nbytes <= pack_quant([tensor]).nbytes <= 1.04 * tensor.data.nbytes


def test_kernels_take_the_lower_instruction_sets_only():
    ops = quant_kernel()
    with pytest.raises(ValueError, match="unknown instruction set"):
        ops.set_isa("avx1024")
    assert native.instruction_sets()[0] == ops.detected_isa() and native.instruction_sets()[-1] == "scalar"


# ---------------------------------------------------------------- a llama in K-quants, end to end

# Q4_K_M's split (llama.cpp): most projections Q4_K, the value and down projections and the head Q6_K
Q4_K_M = {"token_embd": T.Q4_K, "attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_output": T.Q4_K, "ffn_gate": T.Q4_K,
          "ffn_up": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}
N_CTX = 128


@pytest.fixture(scope="module")
def k_quant_llama(tmp_path_factory, default_model):
    """(transformers config, path): a tiny SiLU llama (widths that are multiples of 256, as K-quants
    need) converted by us to f32, its projections then replaced by random Q4_K / Q6_K blocks (gguf
    cannot quantize to K-quants) with Q4_K_M's split of types."""
    from powerinfer.convert.model import gguf_source
    from powerinfer.gguf.writer import TensorData, write_gguf
    from powerinfer.ops.quant import random_blocks

    from conftest import convert_each, make_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-k-quant")
    hf_model = make_tiny_llama(folder, "silu", tokenizer_from=default_model,
                               overrides=dict(hidden_size=256, intermediate_size=512))
    source = gguf_source(convert_each(folder, ("f32",))["f32"])
    rng = np.random.default_rng(0)

    def tensors():
        for name, tensor in source.tensors:
            ggml_type = Q4_K_M.get(name.split(".")[-2])
            if ggml_type is None:
                yield TensorData(name, tensor.data, tensor.ggml_type)
            else:  # scales ~1e-4: weights of about the checkpoint's size
                yield TensorData(name, random_blocks(ggml_type, *tensor.shape, rng, scale=1e-4), ggml_type)

    path = folder / "q4_k_m.gguf"
    write_gguf(path, source.architecture, source.metadata, tensors(), typed_metadata=source.typed_metadata)
    return hf_model.config, path


def k_quant_engine(path, float32: bool = False):
    from powerinfer.gguf import open_gguf
    from powerinfer.models import load_model
    from powerinfer.options import FFNOptions
    from powerinfer.runtime.engine import Engine

    return Engine(load_model(open_gguf(path), N_CTX, FFNOptions(float32=float32)), N_CTX)


@pytest.mark.slow
def test_k_quant_llama_equals_transformers_reading_the_same_file(k_quant_llama):
    from transformers import AutoModelForCausalLM

    config, path = k_quant_llama
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0].float()
    scale = expected.abs().max().item()
    exact = k_quant_engine(path, float32=True).all_logits(ids)
    assert (exact - expected).abs().max().item() < 1e-4 * scale
    fast = k_quant_engine(path).all_logits(ids)  # compact K-quants, activations rounded to bfloat16
    assert (fast - expected).abs().max().item() < 0.05 * scale


@pytest.mark.slow
def test_k_quant_llama_decodes_on_the_native_step(k_quant_llama, isa):
    """The C++ step takes the K-quant projections (mixed Q4_K / Q6_K in one fused qkv) and computes
    what the Python blocks do with the same layers, on each instruction set."""
    _, path = k_quant_llama
    ids = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    native_engine = k_quant_engine(path)
    assert all(isinstance(block.attention.qkv, QuantLinear) and block.step is not None for block in native_engine.model.blocks)
    native_engine.prefill(0, ids[:10])
    native_rows = torch.stack([native_engine.decode([(0, t)])[0] for t in ids[10:]])
    python = k_quant_engine(path)
    for block in python.model.blocks:
        block.step = None
    python.prefill(0, ids[:10])
    python_rows = torch.stack([python.decode([(0, t)])[0] for t in ids[10:]])
    scale, diff = python_rows.abs().max(), (native_rows - python_rows).abs()
    assert diff.max() < 2e-3 * scale and diff.mean() < 1e-4 * scale
