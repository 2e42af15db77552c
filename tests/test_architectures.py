"""Qwen2, Qwen3, Gemma 3, Phi-3 and Mixtral-style mixtures of experts against transformers.

Each tiny random model made with transformers is read twice: converted by our converter, and
written by tests/llamacpp_gguf.py following llama.cpp's conventions (which transformers itself
reads back where it can, checking those conventions independently). In float32 our logits equal
transformers' to 1e-3 of the logit range, for a whole prompt, in chunks and token by token from
the KV cache (past Gemma 3's and Phi-3's sliding windows)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    Phi3Config,
    PreTrainedModel,
)

from powerinfer.convert.hf import hf_source
from powerinfer.errors import UnsupportedModelError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import write_gguf
from powerinfer.models import load_model
from powerinfer.models.layers import _softcapped_attention
from powerinfer.ops import native
from powerinfer.options import FFNOptions
from powerinfer.runtime.engine import Engine

from conftest import convert_each
from helpers import activation_rounding_factor, assert_one_line_error, powerinfer
from llamacpp_gguf import transformers_reading, write_llamacpp_gguf
from tiny_architectures import CASES, LONGROPE, N_CTX, PHI, VOCAB, Case, make


@dataclass
class Tiny:
    name: str
    case: Case
    hf: PreTrainedModel
    ours: dict[str, Path]  # by outtype, converted by powerinfer
    llamacpp: Path | None  # written by tests/llamacpp_gguf.py


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory) -> Tiny:
    folder = tmp_path_factory.mktemp(request.param)
    model = make(request.param)
    model.save_pretrained(folder)
    case = CASES[request.param]
    llamacpp = write_llamacpp_gguf(model, folder, folder / "llamacpp" / "model.gguf") if case.llamacpp else None
    return Tiny(request.param, case, model, convert_each(folder, ("f32", "q8_0")), llamacpp)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, VOCAB, (N_CTX - 8,), generator=torch.Generator().manual_seed(3)).tolist()


def reference(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def engine(path: Path, float32: bool = True, n_batch: int = 512, sparsity="off", n_ctx: int = N_CTX,
           n_slots: int = 1) -> Engine:
    return Engine(load_model(open_gguf(path), n_ctx, FFNOptions(sparsity=sparsity, float32=float32)), n_ctx,
                  n_slots=n_slots, n_batch=n_batch)


def assert_close(ours: torch.Tensor, expected: torch.Tensor, share: float = 1e-3) -> None:
    """max |ours - expected| within `share` of the expected logits' range."""
    span = (expected.max() - expected.min()).item()
    assert (ours - expected).abs().max().item() <= share * span, ((ours - expected).abs().max().item(), span)


def sources(tiny: Tiny) -> list[Path]:
    return [tiny.ours["f32"]] + ([tiny.llamacpp] if tiny.llamacpp is not None else [])


def test_prompt_logits_equal_transformers(tiny, ids):
    expected = reference(tiny.hf, ids)
    for path in sources(tiny):
        assert_close(engine(path).all_logits(ids), expected)


def test_chunked_and_token_by_token_logits_equal_transformers(tiny, ids):
    """Chunks of 5 start after cached tokens; one token at a time reads everything from the cache;
    both go past a sliding window where the model has one."""
    assert not tiny.case.window or len(ids) > 2 * tiny.case.window
    expected = reference(tiny.hf, ids)
    for path in sources(tiny):
        assert_close(engine(path, n_batch=5).all_logits(ids), expected)
        stepwise = engine(path)
        rows = [stepwise.prefill(0, ids[:1])] + [stepwise.decode([(0, t)])[0] for t in ids[1:]]
        assert_close(torch.stack(rows), expected)


@pytest.mark.parametrize("tiny", [name for name, case in CASES.items() if case.readback], indirect=True)
def test_transformers_reads_the_llamacpp_convention_file(tiny, ids):
    assert_close(reference(transformers_reading(tiny.llamacpp), ids), reference(tiny.hf, ids))


def test_quantized_file_is_close_to_transformers(tiny, ids):
    """Q8_0 on the fast path (our kernels, bfloat16 activations). A router whose top choices nearly
    tie picks another expert once the weights are rounded (it does here for a token or two, in
    exact arithmetic on the same file too): for mixtures of experts, 90 % of the positions."""
    ours, expected = engine(tiny.ours["q8_0"], float32=False).all_logits(ids), reference(tiny.hf, ids)
    span = (expected.max() - expected.min()).item()
    close = (ours - expected).abs().amax(-1) <= 0.03 * span
    assert close.float().mean() >= (0.9 if tiny.hf.config.model_type == "mixtral" else 1.0), close


def decode_steps(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits of one sequence decoded token by token past the windows, then of three sequences
    decoded together (one row each per step)."""
    rows = [engine.prefill(0, ids[:1])] + [engine.decode([(0, t)])[0] for t in ids[1:]]
    engine.release(0)
    for slot in range(3):
        engine.prefill(slot, ids[10 * slot : 10 * slot + 3 + slot])
    rows += [row for t in range(20) for row in engine.decode([(slot, ids[t + slot]) for slot in range(3)])]
    return torch.stack(rows)


def test_native_decode_step_equals_the_torch_path(tiny, ids):
    """Quantized blocks of every architecture decode on the C++ step (NeoX and partial RoPE,
    LongRoPE's magnitudes, QKV biases, Q/K norms, post norms, windows, query scales, GELU gates; a
    mixture's experts in torch): the logits of the torch path, which the tests above hold against
    transformers. The native attention rounds differently in float32 and the next projection's
    rounded activations can make that ~2^-9 of an activation (bfloat16; int8 on AVX2 up to ~2^-7
    of its block's largest): close, not equal, and no further
    from the exact arithmetic (float32 weights and activations) than the torch path. A window one
    key too wide is 5 % of the logit range off on average."""
    path = tiny.ours["q8_0"]
    native_engine, python = (engine(path, float32=False, n_slots=3) for _ in range(2))
    if native.load() is None:
        pytest.skip("native operators could not be built here")
    assert all(block.step is not None for block in native_engine.model.blocks)
    for block in python.model.blocks:
        block.step = None
    got, expected = decode_steps(native_engine, ids), decode_steps(python, ids)
    exact = decode_steps(engine(path, n_slots=3), ids)
    scale, diff = expected.abs().max() * activation_rounding_factor(), (got - expected).abs()
    # measured 7e-3, 6e-4 (bfloat16 activations); 1.9e-2, 1.4e-3 with AVX2's int8
    assert diff.max() < 1e-2 * scale and diff.mean() < 1e-3 * scale, (diff.max() / scale, diff.mean() / scale)
    assert (got - exact).abs().mean() <= 1.1 * (expected - exact).abs().mean()


@pytest.mark.parametrize("tiny", ["phi3-longrope"], indirect=True)
def test_longrope_short_factors_within_the_trained_context(tiny, ids):
    """A context no longer than the trained one takes LongRoPE's short factors (llama.cpp chooses by
    context size, transformers by sequence length: the same within it)."""
    trained = LONGROPE["original_max_position_embeddings"]
    expected = reference(tiny.hf, ids[:trained])
    for path in sources(tiny):
        assert_close(engine(path, n_ctx=trained).all_logits(ids[:trained]), expected)


@pytest.mark.parametrize("cached", [0, 6])
def test_soft_capped_attention_equals_transformers(cached):
    """Soft-capped scores (attn_logit_softcapping; Gemma 2 has it, transformers' Gemma 3 ignores it)
    as transformers' Gemma 2 computes them, with grouped KV heads, for a prompt and after cached keys."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    n, length, heads, kv_heads, hd = 5, 5 + cached, 4, 2, 16
    q, k, v = (torch.randn(1, h, m, hd, generator=g) * 2 for h, m in ((heads, n), (kv_heads, length), (kv_heads, length)))
    visible = torch.ones(n, length, dtype=torch.bool).tril(cached)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, head_dim=hd, training=False)
    additive = torch.zeros(1, 1, n, length).masked_fill(~visible, float("-inf"))
    expected, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3, softcap=1.5)
    mask = dict(is_causal=True) if not cached else dict(attn_mask=visible)
    ours = _softcapped_attention(q, k, v, 0.3, 1.5, **mask).transpose(1, 2)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_unsupported_rope_scaling_is_refused_in_one_line(tmp_path):
    """YaRN and other RoPE scalings we do not compute: refused by the converter and at load."""
    Phi3Config(**PHI).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["Phi3ForCausalLM"]
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unsupported rope_scaling .*yarn") as error:
        hf_source(tmp_path)
    assert "\n" not in str(error.value)
    path = tmp_path / "yarn.gguf"
    write_gguf(path, "phi3", {"phi3.rope.scaling.type": "yarn", "phi3.block_count": 1, "phi3.embedding_length": 64,
                              "phi3.feed_forward_length": 96, "phi3.attention.head_count": 4, "phi3.vocab_size": VOCAB}, [])
    assert_one_line_error(powerinfer("run", "-m", str(path), "-p", "hi", "-n", "1"), "unsupported RoPE scaling 'yarn'")
