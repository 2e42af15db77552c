"""Hybrid execution with the accelerator played by the CPU: splitting an FFN between two devices
changes no result, whatever the placement."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from powerinfer import LLM
from powerinfer.config import FFNActivation
from powerinfer.errors import PowerInferError
from powerinfer.gguf import open_gguf
from powerinfer.models import load_model, read_config
from powerinfer.options import FFNOptions
from powerinfer.placement.apply import apply_placement
from powerinfer.placement.costs import ModelShape, Speeds, dense_parts, model_shape
from powerinfer.placement.gpu_index import index_path, read_gpu_index
from powerinfer.placement.solver import Plan, plan_from_counts
from powerinfer.placement.spec import DensePlacement, Placement
from powerinfer.runtime.engine import Engine
from powerinfer.sparse.ffn import MAX_SPARSE_ROWS, DenseFFN, SparseFFN
from powerinfer.sparse.hybrid import HybridFFN
from powerinfer.sparse.predictor import Predictor
from powerinfer.sparse.select import AboveThreshold, AllNeurons, Predicted

from helpers import decode_and_prefill_logits, place_everything, random_store

CPU = torch.device("cpu")
N_CTX = 64

# ---------------------------------------------------------------- one FFN, every mode and encoding


@settings(max_examples=40, deadline=None)
@given(ggml_type=st.sampled_from([T.Q4_0, T.Q4_1, T.Q8_0, T.F32]), gated=st.booleans(),
       mode=st.sampled_from(["auto", "off", "oracle"]), rows=st.sampled_from([1, 2, 3, 12]),
       seed=st.integers(0, 10_000), data=st.data())
def test_hybrid_ffn_equals_sparse_ffn(ggml_type, gated, mode, rows, seed, data):
    n_ff = 96
    store, _ = random_store(seed, ggml_type, n_ff, 64, 64, gated)
    activation = FFNActivation.RELU_GATED if gated else FFNActivation.RELU
    generator = torch.Generator().manual_seed(seed)
    predictor = Predictor.from_weights(torch.randn(16, 64, generator=generator), torch.randn(n_ff, 16, generator=generator), 0.0)
    selector = {"auto": Predicted(predictor), "off": AllNeurons(), "oracle": AboveThreshold(0.0)}[mode]
    single = SparseFFN(store, activation, selector)
    hot = torch.tensor(sorted(data.draw(st.sets(st.integers(0, n_ff - 1), min_size=1))), dtype=torch.int64)
    hybrid = HybridFFN(single, hot, CPU)
    h, residual = torch.randn(rows, 64, generator=generator), torch.randn(rows, 64, generator=generator)
    expected, got = single(h, residual), hybrid(h, residual)
    # Bound by the size of the terms summed: many rows run bfloat16 products on both sides, whose
    # outputs are rounded to bfloat16 (the split rounds two partial sums instead of one).
    scale = (single.activations(h).abs() @ store.weights(store.down).abs()).max().item() + 1e-6
    bf16 = rows > MAX_SPARSE_ROWS and ggml_type != T.F32
    torch.testing.assert_close(got, expected, rtol=0, atol=(1e-2 if bf16 else 1e-5) * scale)
    assert hybrid.device_nbytes == len(hot) * store.record_bytes


@settings(max_examples=30, deadline=None)
@given(ggml_type=st.sampled_from([T.Q4_0, T.Q8_0, T.F32]), rows=st.integers(2, MAX_SPARSE_ROWS),
       split=st.booleans(), seed=st.integers(0, 10_000))
def test_each_row_computes_its_own_predicted_neurons(ggml_type, rows, split, seed):
    """A few rows at once (a short prompt, a batched decode step) give what each row gives alone:
    every token computes the neurons predicted for it, not those predicted for any row."""
    n_ff = 96
    store, _ = random_store(seed, ggml_type, n_ff, 64, 64)
    generator = torch.Generator().manual_seed(seed)
    predictor = Predictor.from_weights(torch.randn(16, 64, generator=generator), torch.randn(n_ff, 16, generator=generator), 0.5)
    ffn = SparseFFN(store, FFNActivation.RELU_GATED, Predicted(predictor))
    if split:
        ffn = HybridFFN(ffn, torch.arange(0, n_ff, 3), CPU)
    h, residual = torch.randn(rows, 64, generator=generator), torch.randn(rows, 64, generator=generator)
    alone = torch.cat([ffn(h[i : i + 1], residual[i : i + 1]) for i in range(rows)])
    together = ffn(h, residual)
    scale = alone.abs().max().item() + 1e-6
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5 * scale)


def test_no_active_neuron_gives_zeros():
    store, _ = random_store(1, T.Q4_0, 64, 64, 32)
    silent = Predictor.from_weights(torch.randn(8, 64), torch.randn(64, 8), threshold=1e9)
    hybrid = HybridFFN(SparseFFN(store, FFNActivation.RELU_GATED, Predicted(silent)), torch.tensor([3, 9]), CPU)
    assert torch.equal(hybrid(torch.randn(1, 64)), torch.zeros(1, 32)) and hybrid.last_active == 0


# ---------------------------------------------------------------- whole models


@pytest.fixture(scope="module")
def relu_models(tiny_relu) -> dict[str, Path]:
    """A tiny ReLU llama in f32 and q4_0, each in its own folder."""
    return {outtype: tiny_relu(outtype) for outtype in ("f32", "q4_0")}


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def engines(relu_models, ids):
    """Per outtype: a sparse model to split in place, and the single-device logits per mode."""
    out = {}
    for outtype, path in relu_models.items():
        model = load_model(open_gguf(path), N_CTX, FFNOptions(sparsity="oracle"))
        reference = {"oracle": decode_and_prefill_logits(model, ids)}
        if outtype == "f32":  # off against the dense model: exact arithmetic either way
            reference["off"] = decode_and_prefill_logits(load_model(open_gguf(path), N_CTX, FFNOptions(sparsity="off")), ids)
        else:  # quantized: the dense model rounds differently, so compare with the same records
            with ffns(model, lambda f, _: SparseFFN(f.store, f.activation, AllNeurons())):
                reference["off"] = decode_and_prefill_logits(model, ids)
        out[outtype] = model, reference
    return out


@contextmanager
def ffns(model, make):
    """Replace every block's FFN with make(ffn, layer) for the duration."""
    saved = [block.ffn for block in model.blocks]
    for i, block in enumerate(model.blocks):
        block.ffn = make(block.ffn, i)
    try:
        yield
    finally:
        for block, ffn in zip(model.blocks, saved):
            block.ffn = ffn


def shape_of(model) -> ModelShape:
    return ModelShape(tuple(b.ffn.store.n_ff for b in model.blocks), tuple(b.ffn.store.record_bytes for b in model.blocks))


@settings(max_examples=12, deadline=None)
@given(outtype=st.sampled_from(["f32", "q4_0"]), mode=st.sampled_from(["oracle", "off"]),
       share=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_hybrid_model_equals_single_device_for_random_budgets(engines, ids, outtype, mode, share, seed):
    model, reference = engines[outtype]
    shape = shape_of(model)
    rng = np.random.default_rng(seed)
    counts = [torch.from_numpy(rng.integers(0, 100, n)) for n in shape.n_ff]
    plan = plan_from_counts(counts, 100, shape, int(share * shape.ffn_bytes), Speeds(sync_seconds=0.0), 16)

    def split(ffn: SparseFFN, layer: int) -> SparseFFN:
        selector = AboveThreshold(ffn.selector.threshold) if mode == "oracle" else AllNeurons()
        single = SparseFFN(ffn.store, ffn.activation, selector)
        hot = torch.from_numpy(plan.hot[layer]).long()
        return HybridFFN(single, hot, CPU) if len(hot) else single

    with ffns(model, split):
        got = decode_and_prefill_logits(model, ids)
    tolerance = 1e-4 if outtype == "f32" else 0.04  # q4_0: logits come out of a bfloat16 kernel
    for value, expected in zip(got, reference[mode]):  # decode, then prefill
        torch.testing.assert_close(value, expected, rtol=0, atol=tolerance * expected.abs().max().item())


def batched_decode_logits(model, ids: list[int]) -> torch.Tensor:
    """Two sequences prefilled in their own slots, then decoded together, one token each per step."""
    engine = Engine(model, N_CTX, n_slots=2)
    engine.prefill(0, ids[:3]), engine.prefill(1, ids[5:9])
    return torch.cat([engine.decode([(0, a), (1, b)]) for a, b in zip(ids[3:8], ids[9:14])])


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from([("f32", "oracle"), ("f32", "off"), ("q4_0", "oracle")]),
       offloaded=st.sets(st.integers(0, 1)), output=st.booleans(), share=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_offloaded_dense_parts_give_the_single_device_result(relu_models, ids, case, offloaded, output, share, seed):
    """Blocks whose norms, attention and KV cache live on the accelerator (x crossing over and back),
    the output head there or not, hot neurons anywhere: the logits of the CPU-only model, for single
    and batched decode steps and prefill. (Quantized "off" is left out: there the CPU-only model's
    FFNs are dense int4 layers, which round differently from neuron records.)"""
    outtype, mode = case
    gguf = open_gguf(relu_models[outtype])
    shape = model_shape(gguf, read_config(gguf))
    rng = np.random.default_rng(seed)
    counts = [torch.from_numpy(rng.integers(0, 100, n)) for n in shape.n_ff]
    plan = plan_from_counts(counts, 100, shape, int(share * shape.ffn_bytes), Speeds(sync_seconds=0.0), 16)
    dense = DensePlacement(frozenset(offloaded), output, 0)
    # Offloaded projections take torch's int4 layout (the accelerator's); here the CPU-kept ones
    # do too, so that only the split differs (the native kernel's own rounding: test_quant_linear).
    with mock.patch("powerinfer.ops.linear.quant_kernel", return_value=None):
        single = load_model(gguf, N_CTX, FFNOptions(sparsity=mode))
        split = load_model(gguf, N_CTX, FFNOptions(sparsity=mode))
        apply_placement(split, Placement(CPU, plan, dense))
    assert [isinstance(b.ffn, HybridFFN) for b in split.blocks] == [i in offloaded or len(plan.hot[i]) > 0
                                                                      for i in range(2)]
    assert all(split.blocks[i].step is None for i in offloaded)  # offloaded blocks run the torch path
    tolerance = 1e-4 if outtype == "f32" else 0.04  # q4_0: the native step and the torch path round differently
    for got, expected in [*zip(decode_and_prefill_logits(split, ids), decode_and_prefill_logits(single, ids)),
                          (batched_decode_logits(split, ids), batched_decode_logits(single, ids))]:
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance * expected.abs().max().item())


def test_placement_splits_only_the_layers_with_hot_neurons(relu_models, engines, ids):
    plan = Plan((np.arange(0, 160, 3, dtype=np.int32), np.zeros(0, dtype=np.int32)), (160, 160), 0, 0,
                None, None, None, None)
    model = load_model(open_gguf(relu_models["f32"]), N_CTX, FFNOptions(sparsity="off"))
    apply_placement(model, Placement(CPU, plan))
    assert isinstance(model.blocks[0].ffn, HybridFFN) and model.blocks[0].ffn.n_hot == len(plan.hot[0])
    assert isinstance(model.blocks[1].ffn, DenseFFN)  # nothing placed: built as without a plan
    for value, expected in zip(decode_and_prefill_logits(model, ids), engines["f32"][1]["off"]):
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-4 * expected.abs().max().item())


@pytest.fixture
def f32_copy(tiny_relu) -> Path:
    """The f32 model alone in a fresh folder (indexes get written next to it)."""
    return tiny_relu("f32")


def test_llm_runs_with_a_stored_index_and_generates_the_same_text(f32_copy, capsys):
    budget = place_everything(f32_copy)
    plain = LLM(f32_copy, n_ctx=N_CTX)
    hybrid = LLM(f32_copy, n_ctx=N_CTX, vram_budget=budget, accelerator="cpu")
    assert all(isinstance(b.ffn, HybridFFN) and len(b.ffn.cold) == 0 for b in hybrid.model.blocks)
    assert hybrid.placement.plan.solve_seconds is None  # read from the index, not solved
    assert "placement on cpu: 2/2 layers use the accelerator" in capsys.readouterr().err
    prompt = "The capital of France is"
    assert hybrid.generate(prompt, max_tokens=12, temperature=0) == plain.generate(prompt, max_tokens=12, temperature=0)


def test_llm_rebuilds_a_corrupt_index_and_honours_reset_and_disable(f32_copy, capsys):
    budget = place_everything(f32_copy)
    index = index_path(f32_copy)
    index.write_bytes(b"PWRI" + bytes(50))
    llm = LLM(f32_copy, n_ctx=N_CTX, vram_budget=budget / 2, accelerator="cpu")
    err = capsys.readouterr().err.splitlines()
    assert sum("warning: ignoring corrupt GPU index" in line for line in err) == 1
    assert llm.placement.plan.solve_seconds is not None
    assert read_gpu_index(index, (160, 160))[1] == llm.placement.plan.capacity  # rewritten, sound
    place_everything(f32_copy)
    assert LLM(f32_copy, n_ctx=N_CTX, vram_budget=budget, accelerator="cpu",
               gpu_index="reset").placement.plan.solve_seconds is not None
    disabled = LLM(f32_copy, n_ctx=N_CTX, vram_budget=budget, accelerator="cpu", gpu_index="disable").placement
    assert not any(disabled.has_hot(i) for i in range(2)) and disabled.dense.layers == {0, 1}  # dense parts still go
    assert "GPU index disabled" in capsys.readouterr().err
    with pytest.raises(PowerInferError, match="needs dtype 'auto'"):
        LLM(f32_copy, n_ctx=N_CTX, vram_budget=1.0, dtype="float32")
    with pytest.raises(PowerInferError, match="VRAM budget must be >= 0"):
        LLM(f32_copy, n_ctx=N_CTX, vram_budget=-1.0, accelerator="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the note printed without a CUDA device")
def test_without_cuda_a_budget_is_a_one_line_note(f32_copy, capsys):
    llm = LLM(f32_copy, n_ctx=N_CTX, vram_budget=4.0)
    assert llm.placement is None and not any(isinstance(b.ffn, HybridFFN) for b in llm.model.blocks)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["powerinfer: no CUDA device: the VRAM budget is ignored and everything runs on the CPU"]
    assert not index_path(f32_copy).exists()
    with pytest.raises(PowerInferError, match="no CUDA device"):
        LLM(f32_copy, n_ctx=N_CTX, vram_budget=4.0, accelerator="cuda")


def test_cli_flags_reach_the_hybrid_engine(f32_copy, capsys):
    from powerinfer.cli import main, parse_args

    budget = place_everything(f32_copy)
    args = ["run", "-m", str(f32_copy), "-p", "Once upon a time", "-n", "8", "--temp", "0", "-c", str(N_CTX)]
    assert main([*args, "--vram-budget", f"{budget:.6f}", "--accelerator", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "placement on cpu: 2/2 layers" in err
    assert out.rstrip("\n") == LLM(f32_copy, n_ctx=N_CTX).generate("Once upon a time", max_tokens=8, temperature=0)
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*args, "--reset-gpu-index", "--disable-gpu-index"])
    assert exit_info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("n_gpu_layers", [1, 2, 3])
def test_layer_offload_gives_the_cpu_result(relu_models, ids, n_gpu_layers, capsys):
    """llama.cpp's -ngl with the CPU standing in: the last N blocks move whole (FFNs dense), the
    output head too when N exceeds the block count."""
    path = relu_models["f32"]
    cpu = LLM(path, n_ctx=N_CTX, sparsity="off")
    offloaded = LLM(path, n_ctx=N_CTX, sparsity="off", n_gpu_layers=n_gpu_layers, accelerator="cpu")
    assert [b.offloaded for b in offloaded.model.blocks] == [i >= 2 - n_gpu_layers for i in range(2)]
    assert all(isinstance(b.ffn, DenseFFN) for b in offloaded.model.blocks)
    assert offloaded.placement.dense.output == (n_gpu_layers > 2)
    assert f"{min(n_gpu_layers, 2)}/2 layers offloaded whole" in capsys.readouterr().err
    for got, expected in zip(decode_and_prefill_logits(offloaded.model, ids), decode_and_prefill_logits(cpu.model, ids)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * expected.abs().max().item())
    with pytest.raises(PowerInferError, match="not both"):
        LLM(path, n_ctx=N_CTX, n_gpu_layers=1, vram_budget=1.0, accelerator="cpu")


def test_the_budget_counts_every_kv_slot(relu_models):
    """A server's --parallel slots each hold a KV cache: a budget that fits the dense parts of every
    block with one slot fits fewer blocks with four."""
    gguf = open_gguf(relu_models["f32"])
    config = read_config(gguf)
    one, four = dense_parts(gguf, config, N_CTX, 1), dense_parts(gguf, config, N_CTX, 4)
    kv_per_slot = 2 * N_CTX * config.kv_dim * 2  # keys and values, float16
    assert [b - a for a, b in zip(one.layers, four.layers)] == [3 * kv_per_slot] * config.n_layers
    budget = sum(one.layers) / 2**30
    placed = lambda parallel: LLM(relu_models["f32"], n_ctx=N_CTX, vram_budget=budget, accelerator="cpu",  # noqa: E731
                                  gpu_index="disable", parallel=parallel).placement.dense.layers
    assert placed(1) == {0, 1} and placed(4) == {1}


def test_models_know_nothing_of_placement(relu_models):
    """Importing the models, or running without a budget, loads neither the placement package nor
    the hybrid executor."""
    script = (f"import sys; from powerinfer import LLM; LLM({str(relu_models['f32'])!r}, n_ctx=32).generate('a', 2); "
              "loaded = [m for m in sys.modules if m.startswith('powerinfer.placement') or m.endswith('hybrid_ffn')]; "
              "assert not loaded, loaded")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
