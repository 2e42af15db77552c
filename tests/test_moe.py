"""A Mixtral-style mixture of experts on the sparse path: every (layer, expert) is an FFN unit of its
own, which the sparse FFNs, the profiler, predictors and placement each handle like a layer's FFN.
Tiny ReGLU Mixtral made with transformers (exact skipping: a neuron that outputs zero is skipped)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from transformers import PreTrainedModel

from powerinfer.convert.model import gguf_source
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.models import load_model, read_config
from powerinfer.models.moe import MoEFFN
from powerinfer.options import FFNOptions
from powerinfer.placement.apply import apply_placement
from powerinfer.placement.costs import Speeds, model_shape
from powerinfer.placement.solver import Plan, plan_from_counts
from powerinfer.placement.spec import Placement
from powerinfer.runtime.engine import Engine
from powerinfer.sparse.ffn import SparseFFN
from powerinfer.sparse.hybrid import HybridFFN
from powerinfer.sparse.predictor import LAYER_THRESHOLDS_KEY, predictor_name
from powerinfer.sparse.predictor_training import TrainingOptions, train_predictors
from powerinfer.sparse.profiler import profile_activations

from conftest import convert_each
from helpers import decode_logits
from tiny_architectures import MOE, VOCAB, make

N_CTX = 256
CHUNK = 256
N_EXPERT = MOE["num_local_experts"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[PreTrainedModel, Path]:
    folder = tmp_path_factory.mktemp("mixtral-relu")
    model = make("mixtral-relu")
    model.save_pretrained(folder)
    return model, convert_each(folder, ("f32",))["f32"]


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def calibration() -> list[int]:
    return torch.randint(0, VOCAB, (4 * CHUNK,), generator=torch.Generator().manual_seed(12)).tolist()


def engine(path: Path, sparsity: str = "off") -> Engine:
    return Engine(load_model(open_gguf(path), N_CTX, FFNOptions(sparsity=sparsity)), N_CTX)


def both_paths(e: Engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token by token after a short prompt: few rows per expert; one prefill: many rows for some)."""
    return decode_logits(e, ids), e.all_logits(ids)


def assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def dense(moe, ids):
    return both_paths(engine(moe[1]), ids)


def test_experts_on_the_sparse_path_equal_dense(moe, ids, dense):
    """Each expert a SparseFFN over its own neurons: computing all of them ("off") or only those
    whose activation is not zero ("oracle") gives the dense result."""
    off = engine(moe[1])
    for unit in off.model.ffn_units():
        unit.replace(unit.ffn.sparse())
    oracle = engine(moe[1], sparsity="oracle")
    for e in (off, oracle):
        units = e.model.ffn_units()
        assert len(units) == 2 * N_EXPERT and all(isinstance(u.ffn, SparseFFN) for u in units)
        assert all(isinstance(b.ffn, MoEFFN) for b in e.model.blocks)
        assert_same(both_paths(e, ids), dense)
    assert any(0 < u.ffn.last_active < u.ffn.n_ff for u in oracle.model.ffn_units())  # really skipped some


def transformers_counts(model: PreTrainedModel, chunks: list[list[int]]) -> list[torch.Tensor]:
    """Per (layer, expert): how often each neuron of transformers' experts outputs non-zero over the
    tokens its router sends there, from transformers' own router and expert weights."""
    layers = model.model.layers
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    hooks = [layer.mlp.register_forward_hook(lambda m, args, out, i=i: inputs[i].append(args[0].reshape(-1, args[0].shape[-1])))
             for i, layer in enumerate(layers)]
    with torch.inference_mode():
        for chunk in chunks:
            model(torch.tensor([chunk]))
    for hook in hooks:
        hook.remove()
    counts = []
    with torch.inference_mode():
        for i, layer in enumerate(layers):
            h = torch.cat(inputs[i])
            _, _, chosen = layer.mlp.gate(h)
            experts = layer.mlp.experts
            for e in range(N_EXPERT):
                rows = h[(chosen == e).any(-1)]
                gate, up = (rows @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
                counts.append(((experts.act_fn(gate) * up) != 0).sum(0))
    return counts


def test_profile_counts_each_expert_over_its_tokens(moe, calibration):
    hf, path = moe
    model = load_model(open_gguf(path), N_CTX, FFNOptions(sparsity="off", float32=True))
    profile = profile_activations(model, calibration, chunk=CHUNK)
    expected = transformers_counts(hf, [calibration[i : i + CHUNK] for i in range(0, len(calibration), CHUNK)])
    assert len(profile.counts) == len(expected) == 2 * N_EXPERT
    for ours, theirs in zip(profile.counts, expected):
        assert torch.equal(ours, theirs.long())


@pytest.fixture(scope="module")
def with_predictors(moe, calibration, tmp_path_factory) -> Path:
    """The model with a predictor per expert (`blk.L.fc1.E`, `blk.L.fc2.E`) trained on its tokens."""
    _, path = moe
    model = load_model(open_gguf(path), CHUNK, FFNOptions(sparsity="off"))
    predictors, reports = train_predictors(model, calibration * 3, [0.0] * 2 * N_EXPERT, None, CHUNK,
                                           TrainingOptions(ranks=(32,), steps=100))
    assert len(predictors) == 2 * N_EXPERT and all(r.recall >= 0.9 for r in reports), reports
    source = gguf_source(path)
    tensors = [TensorData(name, np.asarray(t.data), t.ggml_type) for name, t in open_gguf(path).tensors.items()]
    for unit, p in enumerate(predictors):
        layer, expert = divmod(unit, N_EXPERT)
        tensors += [TensorData(predictor_name(layer, "fc1", expert), p.fc1.numpy(), T.F32),
                    TensorData(predictor_name(layer, "fc2", expert), p.fc2.numpy(), T.F32)]
    out = tmp_path_factory.mktemp("moe-predictors") / "model.gguf"
    write_gguf(out, source.architecture, {LAYER_THRESHOLDS_KEY: [p.threshold for p in predictors]}, tensors,
               powerinfer=True, typed_metadata=source.typed_metadata)
    return out


def test_each_expert_runs_its_own_predictor(with_predictors, ids, dense):
    auto = engine(with_predictors, sparsity="auto")
    units = auto.model.ffn_units()
    assert all(isinstance(u.ffn, SparseFFN) and u.ffn.mode == "auto" for u in units)
    for logits, exact in zip(both_paths(auto, ids), dense):
        assert (logits - exact).norm() / exact.norm() < 0.1  # the few firing neurons predictors miss
    assert any(u.ffn.last_active < u.ffn.n_ff for u in units)


def test_placement_gives_each_expert_its_hot_neurons(moe, ids, calibration):
    """Neurons and bytes per expert; the solver, given each expert's firing counts, splits experts
    between the CPU and the 'accelerator' (the CPU standing in), which changes no result."""
    gguf = open_gguf(moe[1])
    shape = model_shape(gguf, read_config(gguf))
    assert shape.n_ff == (MOE["intermediate_size"],) * 2 * N_EXPERT
    profile = profile_activations(load_model(gguf, N_CTX, FFNOptions(sparsity="off")), calibration, chunk=CHUNK)
    plan = plan_from_counts(profile.counts, profile.tokens, shape, shape.ffn_bytes // 2, Speeds(sync_seconds=0.0), 16)
    assert 0 < sum(len(h) for h in plan.hot) < sum(shape.n_ff)
    model = load_model(gguf, N_CTX, FFNOptions(sparsity="oracle"))
    apply_placement(model, Placement(torch.device("cpu"), plan))
    split = [u for u in model.ffn_units() if isinstance(u.ffn, HybridFFN)]
    assert split and all(u.ffn.n_hot == len(plan.hot[u.index]) for u in split)
    assert_same(both_paths(Engine(model, N_CTX), ids), both_paths(engine(moe[1], sparsity="oracle"), ids))


def test_a_hand_made_plan_splits_exactly_the_experts_it_names(moe, ids):
    n_ff = (MOE["intermediate_size"],) * 2 * N_EXPERT
    hot = tuple(np.arange(0, n, 3, dtype=np.int32) if unit % 2 else np.zeros(0, dtype=np.int32)
                for unit, n in enumerate(n_ff))
    model = load_model(open_gguf(moe[1]), N_CTX, FFNOptions(sparsity="oracle"))
    apply_placement(model, Placement(torch.device("cpu"), Plan(hot, n_ff, 0, 0, None, None, None, None)))
    assert [isinstance(u.ffn, HybridFFN) for u in model.ffn_units()] == [bool(u % 2) for u in range(len(n_ff))]
    assert_same(both_paths(Engine(model, N_CTX), ids), both_paths(engine(moe[1], sparsity="oracle"), ids))


def test_native_attention_step_with_experts_equals_the_torch_path(moe, ids, tmp_path):
    """Quantized Mixtral blocks decode with the C++ step for attention and the experts in torch: the
    same logits as the torch path (to the native attention's float32 rounding, as for llama)."""
    hf, _ = moe
    hf.save_pretrained(tmp_path)
    path = convert_each(tmp_path, ("q8_0",))["q8_0"]
    native, python = engine(path), engine(path)
    if any(block.step is None for block in native.model.blocks):
        pytest.skip("native operators could not be built here")
    for block in python.model.blocks:
        block.step = None
    got, expected = decode_logits(native, ids), decode_logits(python, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3 * expected.abs().max().item())
