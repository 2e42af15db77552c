"""Model forward passes against transformers on tiny random llama models (ReLU and SiLU)."""

from __future__ import annotations

import pytest
import torch

from powerinfer.gguf import open_gguf
from powerinfer.models import load_model
from powerinfer.options import FFNOptions
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.kv_cache import CacheType

from helpers import activation_rounding_factor, decode_logits, greedy, reference_logits

N_CTX = 256


def gguf_reference(path, hf_model) -> torch.nn.Module:
    """transformers' own reading of a GGUF file (it dequantizes with the gguf package).

    GGUF has no standard key for the FFN activation, so the original config is passed along: without
    it transformers would assume SiLU for a ReLU llama.
    """
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=hf_model.config,
                                                dtype=torch.float32).eval()


def engine_for(path, float32: bool = False, n_slots: int = 1, n_batch: int = 512, sparsity="auto",
               cache_type: CacheType = "f32") -> Engine:
    """An engine with, unless asked otherwise, a float32 KV cache: comparisons at float32 rounding."""
    model = load_model(open_gguf(path), N_CTX, FFNOptions(sparsity=sparsity, float32=float32))
    return Engine(model, N_CTX, n_slots=n_slots, n_batch=n_batch, cache_type=cache_type)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, 49152, (48,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_float_gguf_logits_equal_transformers(tiny_llama, ids, outtype):
    hf_model, _, ggufs = tiny_llama
    ours = engine_for(ggufs[outtype]).all_logits(ids)
    expected = reference_logits(hf_model, ids)
    tolerance = 1e-4 if outtype == "f32" else 0.02  # f16 weights round the checkpoint
    assert (ours - expected).abs().max().item() < tolerance * expected.abs().max().item()
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("outtype", ["q8_0", "q4_0", "q4_1"])
def test_quantized_gguf_matches_transformers_reading_same_file(tiny_llama, ids, outtype):
    hf_model, _, ggufs = tiny_llama
    expected = reference_logits(gguf_reference(ggufs[outtype], hf_model), ids)
    scale = expected.abs().max().item()
    exact = engine_for(ggufs[outtype], float32=True).all_logits(ids)
    assert (exact - expected).abs().max().item() < 1e-4 * scale
    assert torch.equal(exact.argmax(-1), expected.argmax(-1))
    # The fast path rounds activations to bfloat16, or on AVX2 to 8 bits (as llama.cpp does).
    fast = engine_for(ggufs[outtype]).all_logits(ids)
    assert (fast - expected).abs().max().item() < 0.05 * activation_rounding_factor() * scale


def test_greedy_continuation_equals_transformers(tiny_llama, ids):
    hf_model, _, ggufs = tiny_llama
    with torch.inference_mode():
        expected = hf_model.generate(torch.tensor([ids[:8]]), max_new_tokens=32, do_sample=False)[0, 8:].tolist()
    assert greedy(engine_for(ggufs["f32"]), ids[:8], 32) == expected


# A float16 cache: batching changes a key's float32 rounding, which can tip its float16 rounding by an ulp
@pytest.mark.parametrize("cache_type, atol", [("f32", 1e-4), ("f16", 1e-3)])
def test_chunked_prefill_and_decode_agree_with_one_pass(tiny_llama, ids, cache_type, atol):
    _, _, ggufs = tiny_llama
    whole = engine_for(ggufs["f32"], cache_type=cache_type).all_logits(ids)
    chunked = engine_for(ggufs["f32"], n_batch=7, cache_type=cache_type).all_logits(ids)
    assert torch.allclose(chunked, whole, atol=atol)
    stepwise = engine_for(ggufs["f32"], cache_type=cache_type)
    rows = [stepwise.prefill(0, ids[:1])] + [stepwise.decode([(0, t)])[0] for t in ids[1:]]
    assert torch.allclose(torch.stack(rows), whole, atol=atol)


def test_float16_cache_is_close_to_float32_cache(tiny_llama, ids):
    """llama.cpp's default cache: keys and values rounded to float16 move logits by about its precision."""
    _, _, ggufs = tiny_llama
    exact, half = (engine_for(ggufs["f32"], cache_type=t) for t in ("f32", "f16"))
    assert half.cache.keys[0].dtype == torch.float16 and half.cache.nbytes * 2 == exact.cache.nbytes
    for a, b in ((exact.all_logits(ids), half.all_logits(ids)), (decode_logits(exact, ids), decode_logits(half, ids))):
        assert 0 < (a - b).abs().max().item() < 2e-3 * a.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_prefix_reuse_gives_same_logits(tiny_llama, ids):
    _, _, ggufs = tiny_llama
    engine = engine_for(ggufs["f32"])
    engine.prefill(0, ids[:30])
    reused = engine.prefill(0, ids[:20] + ids[25:40])  # shares 20 tokens with what the slot holds
    fresh = engine_for(ggufs["f32"]).prefill(0, ids[:20] + ids[25:40])
    assert torch.allclose(reused, fresh, atol=1e-4)


def test_batched_decode_equals_separate_sequences(tiny_llama, ids):
    _, _, ggufs = tiny_llama
    prompts = [ids[:5], ids[10:22], ids[30:33]]
    batched = engine_for(ggufs["q4_0"], n_slots=3)
    for slot, p in enumerate(prompts):
        batched.prefill(slot, p)
    together = batched.decode([(slot, ids[40 + slot]) for slot in range(3)])
    for slot, p in enumerate(prompts):
        alone = engine_for(ggufs["q4_0"])
        alone.prefill(0, p)
        assert torch.allclose(together[slot], alone.decode([(0, ids[40 + slot])])[0], atol=1e-3)


def test_native_decode_step_equals_python_path(tiny_llama, ids):
    """The C++ single-token step (used when available) computes what the Python blocks do. Its
    attention (attention.cpp) rounds differently from torch's in float32, and the next projection's
    bfloat16 activations can turn that into up to ~2^-9 of an activation: close, not equal."""
    _, _, ggufs = tiny_llama
    engine = engine_for(ggufs["q4_1"])
    steps = [block.step for block in engine.model.blocks]
    if any(step is None for step in steps):
        pytest.skip("native operators could not be built here")
    engine.prefill(0, ids[:10])
    native_rows = torch.stack([engine.decode([(0, t)])[0] for t in ids[10:20]])
    for block in engine.model.blocks:
        block.step = None
    python = engine_for(ggufs["q4_1"])
    for block in python.model.blocks:
        block.step = None
    python.prefill(0, ids[:10])
    python_rows = torch.stack([python.decode([(0, t)])[0] for t in ids[10:20]])
    scale, diff = python_rows.abs().max(), (native_rows - python_rows).abs()
    assert diff.max() < 2e-3 * scale and diff.mean() < 1e-4 * scale  # measured: 1e-3 and 2e-5
