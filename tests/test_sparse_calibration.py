"""Calibration, thresholds and allocation of TEAL-style input sparsity (powerinfer/sparse/).

The masked model is checked against transformers with the same masks applied by hooks on its
linears; allocations against their targets, measured on the calibration text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from powerinfer.errors import PowerInferError
from powerinfer.gguf import open_gguf
from powerinfer.models import load_model
from powerinfer.ops.linear import DenseLinear
from powerinfer.options import FFNOptions
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.kv_cache import SeqSpan
from powerinfer.sparse.allocate import (
    PPL_SEARCH_STEPS,
    Allocator,
    BlockCurve,
    BlockProbe,
    block_curve,
    calibration_perplexity,
    global_sparsities,
)
from powerinfer.sparse.calibrate import calibrate, calibration_chunks
from powerinfer.sparse.sites import HEAD, SITE_KINDS, masked, model_sites, tapped

from conftest import convert_each, make_tiny_llama
from tiny_architectures import N_CTX, VOCAB, make

CHUNK = N_CTX
# transformers' module names of each site's linears
HF_SITES = {"attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn_out": ("self_attn.o_proj",),
            "ffn_in": ("mlp.gate_proj", "mlp.up_proj"), "ffn_down": ("mlp.down_proj",)}


@pytest.fixture(scope="module", params=["swiglu", "geglu"])
def tiny(request, tmp_path_factory):
    """(transformers model, f32 GGUF) of a tiny SwiGLU llama or GeGLU Gemma 3 (two layers, small heads)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "swiglu":
        hf = make_tiny_llama(folder, "silu", overrides=dict(vocab_size=VOCAB))
    else:
        hf = make("gemma3-stated")
        hf.save_pretrained(folder)
    return hf, convert_each(folder, ("f32",))["f32"]


def load(path: Path):
    return load_model(open_gguf(path), N_CTX, FFNOptions(sparsity="off", float32=True))


def random_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def calibrated(tiny):
    model = load(tiny[1])
    return model, calibrate(model, calibration_chunks(random_ids(1024), None, chunk=CHUNK), progress=False)


@pytest.fixture(scope="module")
def allocators(calibrated):
    """An Allocator per criterion, shared so that each measures its greedy curves once."""
    return {c: Allocator(calibrated[1], c, progress=False) for c in ("teal", "wina")}


def logits(model, ids: list[int]) -> torch.Tensor:
    return Engine(model, N_CTX).all_logits(ids)


def test_threshold_zero_equals_dense(calibrated, allocators):
    model, calibration = calibrated
    ids = random_ids(N_CTX, seed=1)
    dense = logits(model, ids)
    zeros = {s.name: torch.zeros(s.in_features) for s in calibration.sites}
    with masked(calibration.sites, zeros):
        assert torch.equal(logits(model, ids), dense)
    allocation = allocators["teal"].allocate(0.5, "uniform")
    with masked(calibration.sites, allocation.thresholds):
        assert not torch.allclose(logits(model, ids), dense, atol=1e-3)  # the masks do act


@pytest.mark.parametrize("criterion", ["teal", "wina"])
def test_masked_model_equals_transformers_with_the_same_masks(tiny, calibrated, allocators, criterion):
    hf, _ = tiny
    model, calibration = calibrated
    allocation = allocators[criterion].allocate(0.4, "uniform")
    hooks = []
    for layer, hf_layer in enumerate(hf.model.layers):
        for kind, names in HF_SITES.items():
            t = allocation.sites[f"blk.{layer}.{kind}"].thresholds
            for name in names:
                module = hf_layer.get_submodule(name)
                hooks.append(module.register_forward_pre_hook(lambda m, args, t=t: (args[0] * (args[0].abs() > t),)))
    head = allocation.sites[HEAD].thresholds  # the head is a site too
    hooks.append(hf.lm_head.register_forward_pre_hook(lambda m, args: (args[0] * (args[0].abs() > head),)))
    ids = random_ids(N_CTX - 8, seed=2)
    try:
        with torch.inference_mode():
            expected = hf(torch.tensor([ids])).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()
    with masked(calibration.sites, allocation.thresholds):
        ours = logits(model, ids)
    span = (expected.max() - expected.min()).item()
    assert (ours - expected).abs().max().item() <= 1e-3 * span


def skipped_fraction(calibration, thresholds) -> float:
    """The fraction of the block linears' weights not read over the calibration chunks, counted."""
    skipped = dict.fromkeys(thresholds, 0.0)
    rows = dict.fromkeys(thresholds, 0)

    def counter(name):
        def count(x):
            skipped[name] += float((x.abs() <= thresholds[name]).float().mean(-1).sum())
            rows[name] += x.shape[0]
            return x
        return count

    with tapped(calibration.sites, {n: counter(n) for n in thresholds}):
        for chunk in calibration.chunks:
            Engine(calibration.model, N_CTX).all_logits(chunk)
    weights = {s.name: s.weight_count for s in calibration.sites}
    return sum(skipped[n] / rows[n] * weights[n] for n in thresholds) / sum(weights.values())


@pytest.mark.parametrize("method", ["uniform", "blockwise", "global", "measured"])
def test_allocation_hits_its_target(calibrated, allocators, method):
    _, calibration = calibrated
    for target in (0.3, 0.6):
        allocation = allocators["wina"].allocate(target, method)
        assert allocation.sparsity == pytest.approx(target, abs=0.005)
        assert skipped_fraction(calibration, allocation.thresholds) == pytest.approx(target, abs=0.02)


def layer_sites(calibration, layer: int) -> list:
    return [s for s in calibration.sites if s.layer == layer]


def test_only_the_sites_taking_part_get_a_share(calibrated):
    """sparsify spreads the target over the sites whose skipping pays; the others stay dense, and
    the head (outside every block) takes the target."""
    _, calibration = calibrated
    part = ["blk.1.ffn_in", "blk.1.ffn_down", HEAD]
    allocator = Allocator(calibration, "wina", progress=False, taking_part=part)
    for method in ("uniform", "blockwise", "global"):
        allocation = allocator.allocate(0.4, method)
        assert set(allocation.sites) == {s.name for s in calibration.sites}
        assert all(a.sparsity == 0 for name, a in allocation.sites.items() if name not in part)
        assert allocation.sites[HEAD].sparsity == pytest.approx(0.4)
        blocks = sum(allocation.sites[n].sparsity * allocation.weights[n] for n in part[:2])
        assert blocks == pytest.approx(0.4 * sum(allocation.weights[n] for n in part[:2]), rel=0.01)


def test_greedy_is_deterministic(calibrated, allocators):
    model, calibration = calibrated
    again = block_curve(calibration, 1, layer_sites(calibration, 1), "wina", model.new_cache(N_CTX, 1, "f32"))
    assert again.points == allocators["wina"].curves[1].points and again.errors == allocators["wina"].curves[1].errors


def test_allocation_has_less_block_error_than_uniform(calibrated, allocators):
    """At the same model-level sparsity, the summed relative block errors the greedy minimizes are
    lower than uniform thresholds give."""
    model, calibration = calibrated
    assert all(c.errors[0] == 0.0 and len(c.points) == 1 + 4 * 9 for c in allocators["wina"].curves)
    cache = model.new_cache(N_CTX, 1, "f32")
    probes = [BlockProbe(calibration, layer, layer_sites(calibration, layer), cache) for layer in range(len(model.blocks))]
    total_error = {}
    for method in ("uniform", "global"):
        allocation = allocators["wina"].allocate(0.5, method)
        total_error[method] = sum(p.error(allocation.thresholds) for p in probes)
    assert len({round(a.sparsity, 3) for a in allocation.sites.values()}) > 1
    assert total_error["global"] < total_error["uniform"]


def test_block_error_is_the_mean_of_each_tokens_relative_error(calibrated, allocators):
    """What the greedy minimizes: per token |masked - dense|^2 / |dense|^2 of the block's output,
    averaged over the probe tokens (a sum over tokens would be decided by the few with a huge
    residual stream, as Gemma 3's first token)."""
    model, calibration = calibrated
    cache = model.new_cache(N_CTX, 1, "f32")
    sites = layer_sites(calibration, 1)
    thresholds = allocators["wina"].allocate(0.5, "uniform").thresholds
    block = model.blocks[1]
    ratios = []
    with torch.inference_mode():
        for x in calibration.probe_inputs[1]:
            spans = [SeqSpan(0, 0, len(x))]
            dense = block(x, spans, cache).double()
            with masked(sites, thresholds):
                sparse = block(x, spans, cache).double()
            ratios.append((sparse - dense).square().sum(dim=1) / dense.square().sum(dim=1))
    expected = float(torch.cat(ratios).mean())
    assert expected > 0
    assert BlockProbe(calibration, 1, sites, cache).error(thresholds) == pytest.approx(expected, rel=1e-6)


def test_greedy_prefers_the_site_whose_masking_costs_less(tiny):
    """Block 0's attention output projection zeroed: skipping either attention input costs
    nothing, so the greedy takes all their steps before any of the FFN's."""
    model = load(tiny[1])
    site = next(s for s in model_sites(model) if s.name == "blk.0.attn_out")
    site.put(DenseLinear(torch.zeros(site.linear.out_features, site.linear.in_features)))
    calibration = calibrate(model, calibration_chunks(random_ids(1024), None, chunk=CHUNK), progress=False)
    curve = block_curve(calibration, 0, layer_sites(calibration, 0), "teal", model.new_cache(N_CTX, 1, "f32"))
    assert curve.points[18] == {"attn_in": pytest.approx(0.9), "attn_out": pytest.approx(0.9), "ffn_in": 0.0,
                                "ffn_down": 0.0}
    assert curve.errors[18] == 0.0 and curve.errors[19] > 0.0


def test_global_greedy_spends_the_target_where_error_is_cheapest():
    """Two blocks of equal weights: steps of block 1 cost a tenth of block 0's, so a target that
    block 1 alone can meet leaves block 0 dense."""
    weights = dict.fromkeys(SITE_KINDS, 100)
    points = [{k: 0.1 * min(max(j - i * 9, 0), 9) for i, k in enumerate(SITE_KINDS)} for j in range(37)]
    steep = BlockCurve(0, weights, points, [0.01 * j for j in range(37)])
    flat = BlockCurve(1, weights, points, [0.001 * j for j in range(37)])
    sparsities = global_sparsities([steep, flat], 0.25)
    assert all(sparsities[f"blk.0.{k}"] == 0 for k in SITE_KINDS)
    assert sum(sparsities[f"blk.1.{k}"] for k in SITE_KINDS) / 4 == pytest.approx(0.5)


@pytest.mark.parametrize("ids", [[], [1], random_ids(1000)])
def test_too_short_calibration_text_is_refused(ids):
    with pytest.raises(PowerInferError, match="calibration text too short"):
        calibration_chunks(ids, None)


def test_bad_targets_are_refused(calibrated, allocators):
    with pytest.raises(PowerInferError, match="target sparsity"):
        allocators["teal"].allocate(1.5, "uniform")
    with pytest.raises(PowerInferError, match="unknown allocation method"):
        allocators["teal"].allocate(0.5, "random")
    with pytest.raises(PowerInferError, match="unknown selection criterion"):
        Allocator(calibrated[1], "magnitude")
    with pytest.raises(PowerInferError, match="perplexity increase"):
        allocators["teal"].within_perplexity(0.5)


def test_max_perplexity_increase_finds_the_largest_target_within_it(calibrated, allocators):
    _, calibration = calibrated
    # the block sites: masking this random tiny model's head lowers its perplexity on random ids
    allocator = Allocator(calibration, "wina", progress=False, measure_chunks=2,
                          taking_part=[s.name for s in calibration.sites if s.layer is not None])
    chunks = calibration.chunks[:2]
    dense = calibration_perplexity(calibration, None, chunks)
    found = {}
    for method in ("blockwise", "uniform"):
        allocation = found[method] = allocator.within_perplexity(1.02, method)
        assert allocation.method == method
        assert calibration_perplexity(calibration, allocation, chunks) <= 1.02 * dense
        assert 0 < allocation.target < 0.9
        above = allocator.allocate(allocation.target + 0.9 / 2**PPL_SEARCH_STEPS, method)  # where the bisection stopped
        assert calibration_perplexity(calibration, above, chunks) > 1.02 * dense
    # "measured" keeps the larger of the two
    measured = allocator.within_perplexity(1.02)
    assert measured.sparsity == max(a.sparsity for a in found.values())


def test_measured_allocation_is_whichever_method_the_calibration_perplexity_prefers(calibrated):
    _, calibration = calibrated
    allocator = Allocator(calibration, "wina", progress=False, measure_chunks=2,
                          taking_part=[s.name for s in calibration.sites if s.layer is not None])
    chunks = calibration.chunks[:2]
    for target in (0.3, 0.6):
        ppl = {m: calibration_perplexity(calibration, allocator.allocate(target, m), chunks) for m in ("blockwise", "uniform")}
        measured = allocator.allocate(target)  # the default method
        assert measured.method == min(ppl, key=ppl.get) and measured.target == target
        assert calibration_perplexity(calibration, measured, chunks) == min(ppl.values())
