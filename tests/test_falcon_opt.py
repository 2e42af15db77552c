"""Falcon and OPT: tiny random transformers models converted by us and run against transformers;
oracle sparsity, predictors, PowerInfer GGUF and hybrid splits on the ReLU ones."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM, OPTConfig, OPTForCausalLM, PreTrainedModel

from powerinfer import LLM
from powerinfer.config import FFNActivation
from powerinfer.convert.encode import parse_outtype
from powerinfer.convert.hf import hf_source
from powerinfer.convert.model import gguf_source, write_model
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf import open_gguf
from powerinfer.models import load_model
from powerinfer.options import FFNOptions
from powerinfer.placement.apply import apply_placement
from powerinfer.placement.solver import Plan
from powerinfer.placement.spec import Placement
from powerinfer.runtime.engine import Engine
from powerinfer.sparse.ffn import SparseFFN
from powerinfer.sparse.hybrid import HybridFFN
from powerinfer.sparse.predictor_training import TrainingOptions, load_predictors, save_predictors, train_predictors
from powerinfer.tokenizer import Tokenizer

from conftest import convert_each
from helpers import (
    assert_one_line_error,
    decode_logits,
    engine,
    greedy,
    powerinfer,
    read_back_powerinfer_gguf,
    reference_logits,
)

N_CTX = 128
VOCAB = 49152  # the default model's tokenizer
OPTIONS = TrainingOptions(ranks=(64,), steps=100)  # one rank, few steps: fast; the threshold still gives the recall
TOKENS, CHUNK = 2048, 256
N_FF = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)

# name -> (architecture in the GGUF, KV heads, transformers model); all but falcon-gelu are ReLU models
MODELS = {
    "falcon-relu": ("falcon", 1, lambda: FalconForCausalLM(FalconConfig(  # 7B layout, multi-query
        **SMALL, ffn_hidden_size=N_FF, activation="relu", max_position_embeddings=512, initializer_range=0.15))),
    "falcon-gelu": ("falcon", 4, lambda: FalconForCausalLM(FalconConfig(  # 7B layout, multi-head
        **SMALL, ffn_hidden_size=N_FF, multi_query=False, max_position_embeddings=512, initializer_range=0.15))),
    "falcon-new": ("falcon", 2, lambda: FalconForCausalLM(FalconConfig(  # 40B layout: KV groups, two norms
        **SMALL, ffn_hidden_size=N_FF, activation="relu", new_decoder_architecture=True, num_kv_heads=2,
        max_position_embeddings=512, initializer_range=0.15))),
    "opt": ("opt", 4, lambda: OPTForCausalLM(OPTConfig(
        **SMALL, ffn_dim=N_FF, word_embed_proj_dim=64, max_position_embeddings=512, init_std=0.15))),
}


@dataclass
class Tiny:
    name: str
    architecture: str
    n_head_kv: int
    hf: PreTrainedModel  # the checkpoint we converted
    reference: PreTrainedModel  # what we compute exactly: hf, with tanh GELU where hf has the exact one
    folder: Path
    ggufs: dict[str, Path]

    @property
    def relu(self) -> bool:
        return self.name != "falcon-gelu"


def make(name: str) -> PreTrainedModel:
    torch.manual_seed(0)
    model = MODELS[name][2]().eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0, which would hide their bugs
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory, default_model) -> Tiny:
    folder = tmp_path_factory.mktemp(request.param)
    model = make(request.param)
    model.save_pretrained(folder)
    Tokenizer.from_gguf(open_gguf(default_model)).backend.save(str(folder / "tokenizer.json"))
    reference = model
    if request.param == "falcon-gelu":  # llama.cpp (and we) compute GELU with the tanh approximation
        reference = copy.deepcopy(model)
        for layer in reference.transformer.h:
            layer.mlp.act = torch.nn.GELU(approximate="tanh")
    architecture, n_head_kv, _ = MODELS[request.param]
    return Tiny(request.param, architecture, n_head_kv, model, reference, folder,
                convert_each(folder, ("f32", "f16", "q8_0")))


@pytest.fixture(scope="module")
def relu(tiny) -> Tiny:
    if not tiny.relu:
        pytest.skip("ReLU models only")
    return tiny


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()


# ---------------------------------------------------------------- dense, against transformers


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_dense_logits_equal_transformers(tiny, ids, outtype):
    llm = LLM(tiny.ggufs[outtype], n_ctx=N_CTX, sparsity="off", cache_type=outtype)  # float32 exact throughout
    assert (llm.config.architecture, llm.config.n_head_kv) == (tiny.architecture, tiny.n_head_kv)
    assert llm.config.activation == (FFNActivation.RELU if tiny.relu else FFNActivation.GELU)
    ours = torch.from_numpy(llm.logits(ids))
    expected = reference_logits(tiny.reference, ids)
    tolerance = 1e-4 if outtype == "f32" else 0.02  # f16 weights round the checkpoint
    assert (ours - expected).abs().max().item() < tolerance * expected.abs().max().item()
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_gelu_falcon_is_close_to_the_exact_gelu(tiny, ids):
    if tiny.relu:
        pytest.skip("GELU model only")
    ours = torch.from_numpy(LLM(tiny.ggufs["f32"], n_ctx=N_CTX, sparsity="off").logits(ids))
    exact = reference_logits(tiny.hf, ids)
    assert (ours - exact).abs().max().item() < 0.01 * exact.abs().max().item()


def test_quantized_logits_are_close_to_transformers(tiny, ids):
    ours = torch.from_numpy(LLM(tiny.ggufs["q8_0"], n_ctx=N_CTX, sparsity="off").logits(ids))
    expected = reference_logits(tiny.reference, ids)
    assert (ours - expected).abs().max().item() < 0.05 * expected.abs().max().item()


def test_greedy_continuation_equals_transformers(tiny, ids):
    with torch.inference_mode():
        out = tiny.reference.generate(torch.tensor([ids[:8]]), max_new_tokens=24, do_sample=False)[0, 8:].tolist()
    # transformers stops at its end-of-sequence token: the prefix it made must match
    assert greedy(engine(tiny.ggufs["f32"], sparsity="off"), ids[:8], 24)[: len(out)] == out


# ---------------------------------------------------------------- sparse


def both_paths(e: Engine, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits token by token after a 6-token prompt: sparse FFNs compute per neuron; logits of one
    prefill: sparse FFNs run as masked dense GEMMs)."""
    return decode_logits(e, ids), e.all_logits(ids)


@pytest.fixture(scope="module")
def dense(relu, ids) -> tuple[torch.Tensor, torch.Tensor]:
    return both_paths(engine(relu.ggufs["f32"], sparsity="off"), ids)


def assert_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_oracle_equals_dense(relu, ids, dense):
    """ReLU: skipping exactly the neurons whose output (up bias included) is zero changes nothing."""
    sparse = engine(relu.ggufs["f32"], sparsity="oracle")
    assert_same(both_paths(sparse, ids), dense)
    assert all(0 < b.ffn.last_active < b.ffn.store.n_ff for b in sparse.model.blocks)  # really sparse


@pytest.fixture(scope="module")
def trained(relu, wikitext_valid, tmp_path_factory) -> tuple[Path, list]:
    """(predictor directory, held-out reports) for a ReLU model (firing: any non-zero output)."""
    llm = LLM(relu.ggufs["f32"], n_ctx=CHUNK, sparsity="off")
    ids = llm.tokenize(wikitext_valid, add_bos=False)
    predictors, reports = train_predictors(llm.model, ids, [0.0] * llm.config.n_layers, TOKENS, CHUNK, OPTIONS)
    out = tmp_path_factory.mktemp("predictors") / relu.name
    save_predictors(out, predictors, reports)
    return out, reports


@pytest.fixture(scope="module")
def pwri(relu, trained, tmp_path_factory) -> Path:
    """The checkpoint converted to a float32 PowerInfer GGUF with the trained predictors."""
    path = tmp_path_factory.mktemp("pwri") / f"{relu.name}.powerinfer.gguf"
    write_model(hf_source(relu.folder), path, parse_outtype("f32"), load_predictors(trained[0]), progress=False)
    return path


def test_predictors_reach_the_recall_target_on_held_out_text(trained):
    _, reports = trained
    for r in reports:
        assert r.recall >= 0.99, r
        assert 0.0 < r.true_sparsity < 1.0 and 0.0 < r.predicted_sparsity <= r.true_sparsity + 0.05, r


def hf_down(model: PreTrainedModel, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the FFN's down projection in block `layer`."""
    if isinstance(model, OPTForCausalLM):
        fc2 = model.model.decoder.layers[layer].fc2
        return fc2.weight.detach(), fc2.bias.detach()
    return model.transformer.h[layer].mlp.dense_4h_to_h.weight.detach(), None


def test_powerinfer_gguf_holds_predictors_and_transposed_down(relu, pwri, tmp_path):
    tensors = {t.name: np.asarray(t.data) for t in read_back_powerinfer_gguf(pwri, tmp_path).tensors}  # checks the PWRI magic
    for i in range(relu.hf.config.num_hidden_layers):
        assert {f"blk.{i}.fc1.weight", f"blk.{i}.fc2.weight"} <= tensors.keys()
        assert not {f"blk.{i}.ffn_down.weight", f"blk.{i}.ffn_down.bias"} & tensors.keys()
        weight, bias = hf_down(relu.hf, i)
        np.testing.assert_array_equal(tensors[f"blk.{i}.ffn_down_t.weight"], weight.numpy().T)
        if bias is not None:  # PowerInfer's name for OPT's down bias
            np.testing.assert_array_equal(tensors[f"blk.{i}.ffn_down_t.bias"], bias.numpy())


def test_sparse_modes_on_powerinfer_gguf(pwri, ids, dense):
    assert_same(both_paths(engine(pwri, float32=True), ids), dense)  # dense FFNs from ffn_down_t (and its bias)
    assert_same(both_paths(engine(pwri, sparsity="off"), ids), dense)
    assert_same(both_paths(engine(pwri, sparsity="oracle"), ids), dense)
    auto = engine(pwri, sparsity="auto")
    for logits, exact in zip(both_paths(auto, ids), dense):
        # The 1 % of firing neurons missed: small, though not near zero in random models with random biases
        assert (logits - exact).norm() / exact.norm() < 0.1
    assert all(isinstance(b.ffn, SparseFFN) and b.ffn.last_active < b.ffn.store.n_ff for b in auto.model.blocks)


@pytest.fixture(scope="module")
def opt(relu) -> Tiny:
    if relu.name != "opt":
        pytest.skip("OPT only: the model with FFN biases")
    return relu


@pytest.mark.parametrize("mode", ["auto", "oracle"])
def test_hybrid_split_changes_nothing(opt, pwri, ids, mode):
    """Half the neurons on the 'accelerator' (the CPU here): the up bias goes with each neuron, the
    down bias is added once."""
    n_ff = (N_FF,) * opt.hf.config.num_hidden_layers
    plan = Plan(tuple(np.arange(0, n, 2, dtype=np.int32) for n in n_ff), n_ff, 0, 0, None, None, None, None)
    split = load_model(open_gguf(pwri), N_CTX, FFNOptions(sparsity=mode))
    apply_placement(split, Placement(torch.device("cpu"), plan))
    assert all(isinstance(b.ffn, HybridFFN) for b in split.blocks)
    assert_same(both_paths(Engine(split, N_CTX, cache_type="f32"), ids), both_paths(engine(pwri, sparsity=mode), ids))


def test_powerinfer_gguf_round_trips(opt, pwri, tmp_path):
    again = tmp_path / "again.gguf"
    write_model(gguf_source(pwri), again, None, progress=False)  # rewritten as it is
    a, b = read_back_powerinfer_gguf(pwri, tmp_path), read_back_powerinfer_gguf(again, tmp_path)
    assert {k: (f.contents(), f.types) for k, f in a.fields.items()} == {k: (f.contents(), f.types) for k, f in b.fields.items()}
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert (x.name, x.tensor_type) == (y.name, y.tensor_type)
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data))
    assert "blk.0.ffn_down_t.bias" in {t.name for t in b.tensors}


# ---------------------------------------------------------------- what we refuse


@pytest.mark.parametrize("config, fragment", [
    (FalconConfig(alibi=True), "alibi=true"),
    (FalconConfig(parallel_attn=False), "parallel_attn=false"),
    (FalconConfig(bias=True), "bias=true"),
    (FalconConfig(activation="silu"), "activation 'silu'"),
    (OPTConfig(do_layer_norm_before=False), "do_layer_norm_before=false"),
    (OPTConfig(word_embed_proj_dim=512), "word_embed_proj_dim"),
])
def test_unsupported_variants_are_refused_by_name(tmp_path, config, fragment):
    config.architectures = ["FalconForCausalLM" if isinstance(config, FalconConfig) else "OPTForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="not supported") as error:
        hf_source(tmp_path)
    assert fragment in str(error.value)


def test_cli_refuses_alibi_falcon_in_one_line(tmp_path):
    config = FalconConfig(alibi=True)
    config.architectures = ["FalconForCausalLM"]
    config.save_pretrained(tmp_path)
    assert_one_line_error(powerinfer("convert", str(tmp_path), "--outfile", str(tmp_path / "out.gguf")),
                          "alibi=true", "not supported")
