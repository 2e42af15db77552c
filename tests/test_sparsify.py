"""`powerinfer sparsify` end to end (issue 25): a tiny random model of each SwiGLU/GeGLU architecture
is sparsified on the repository's calibration text; the gguf package reads the file back; the
sparsified model decodes as the masked-dense model of its source computes (the thresholds applied to
each linear's input), runs dense with --sparsity off, and the command refuses bad input in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from powerinfer import LLM
from powerinfer.gguf import open_gguf
from powerinfer.ops import native
from powerinfer.sparse import sparsify as sparsify_module
from powerinfer.sparse.allocate import Allocator
from powerinfer.sparse.payoff import DECODE_MARGIN, NEVER, BreakEven
from powerinfer.sparse.sites import HEAD, masked, model_sites
from powerinfer.sparse.sparsify import (
    PROMPT_TOKENS,
    Target,
    allocate_where_it_pays,
    calibration_of,
    sparsify,
    write_sparsified,
)
from powerinfer.sparse.storage import THRESHOLDS_SUFFIX, sparse_sites
from powerinfer.tokenizer import Tokenizer

from conftest import convert_each, make_tiny_llama
from helpers import assert_one_line_error, powerinfer
from tiny_architectures import GEMMA, PHI, SMALL

CALIBRATION = Path(__file__).parent / "data" / "wikitext-2" / "valid.txt"
VOCAB = 49152  # the default model's tokenizer (the calibration text needs a real one)
ARCHITECTURES = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**dict(SMALL, vocab_size=VOCAB))),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**dict(SMALL, vocab_size=VOCAB, head_dim=32))),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**dict(PHI, vocab_size=VOCAB))),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**dict(GEMMA, vocab_size=VOCAB, num_hidden_layers=2,
                                                                 head_dim=32, query_pre_attn_scalar=32))),
}
PROMPT = "The tower is 324 metres tall, about the same height as an 81-storey building"


def save_tiny(folder: Path, name: str, default_model: Path) -> Path:
    """A tiny random model of architecture `name` with the default model's tokenizer, as Q8_0 (a type
    that channel runs take)."""
    if name == "llama":
        make_tiny_llama(folder, "silu")
    else:
        torch.manual_seed(0)
        model = ARCHITECTURES[name]().eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(folder)
    Tokenizer.from_gguf(open_gguf(default_model)).backend.save(str(folder / "tokenizer.json"))
    return convert_each(folder, ("q8_0",))["q8_0"]


@pytest.fixture(scope="module", params=["llama", *ARCHITECTURES])
def sparsified(request, tmp_path_factory, default_model) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    source = save_tiny(folder, request.param, default_model)
    output = folder / "sparse.gguf"
    # every site skipping: whether a tiny model's runs beat its rows on this machine is not the question here
    sparsify(LLM(source, sparsity="off"), CALIBRATION.read_text(), output, Target(sparsity=0.5), n_tokens=1024,
             progress=False, all_sites=True)
    return source, output


def decode_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The logits of each position, one token per step (the single-row path that skips channels)."""
    engine = llm.engine
    engine.release(0)
    return torch.stack([engine.extend(0, [i])[-1].float() for i in ids])


def test_the_gguf_package_reads_the_sparsified_file(sparsified):
    """The source's tensors, byte for byte (no re-quantization, one copy of each), plus thresholds."""
    source, output = sparsified
    names = {t.name: t for t in GGUFReader(output).tensors}
    originals = {t.name: t for t in GGUFReader(source).tensors}
    for name, tensor in originals.items():
        assert tensor.tensor_type == names[name].tensor_type
        assert np.array_equal(np.asarray(tensor.data), np.asarray(names[name].data))
    thresholds = [n for n in names if n.endswith(THRESHOLDS_SUFFIX)]
    assert thresholds and set(names) == set(originals) | set(thresholds)
    assert all(np.all(names[n].data >= 0) for n in thresholds)


def test_sparsified_model_decodes_as_its_masked_dense_form(sparsified):
    """Each token alone: the sparsified file's logits are those of the same file run dense
    (--sparsity off) with every stored site's input masked by the file's thresholds (TEAL's
    selection: channel i read when |x_i| > threshold_i), and differ from the unmasked ones."""
    _, output = sparsified
    if "avx2" not in native.instruction_sets():
        pytest.skip("the reference needs the AVX2 row kernels (x rounded to int8, as the channel runs round it)")
    sparse = LLM(output)
    ids = sparse.tokenize(PROMPT)[:24]
    ours = decode_logits(sparse, ids)
    thresholds = {name.removesuffix(THRESHOLDS_SUFFIX): torch.from_numpy(np.array(t.data, dtype=np.float32))
                  for name, t in open_gguf(output).tensors.items() if name.endswith(THRESHOLDS_SUFFIX)}
    # The reference runs the torch path through the AVX2 row kernels, which round x to int8 per block
    # of 32 inputs as the runs do on every instruction set (a few tenths of a percent per linear). The
    # AVX-512 and scalar row kernels round x to bfloat16 instead, and on these tiny random models that
    # difference moves later layers' inputs across their thresholds: 30 % of the largest logit.
    with native.instruction_set("avx2"):
        dense = LLM(output, sparsity="off")
        with masked(model_sites(dense.model), thresholds):
            expected = decode_logits(dense, ids)
        unmasked = decode_logits(dense, ids)
    error = (ours - expected).abs().max()
    assert error < 1e-2 * expected.abs().max()
    assert (ours - unmasked).abs().max() > 10 * error


def test_sparsity_off_runs_the_sparsified_file_dense(sparsified):
    """--sparsity off: the source's logits exactly (the file's rows are the source's)."""
    source, output = sparsified
    off, dense = LLM(output, sparsity="off"), LLM(source)
    ids = off.tokenize(PROMPT)[:16]
    assert torch.equal(decode_logits(off, ids), decode_logits(dense, ids))
    text = LLM(output).create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    assert isinstance(text, str) and text  # generation runs end to end


def test_one_calibration_writes_what_sparsify_writes(tmp_path, default_model):
    """write_sparsified on a calibration computed once (calibration_of) writes, for each target and
    allocation, the very bytes `sparsify` writes after calibrating on its own."""
    source = save_tiny(tmp_path, "llama", default_model)
    llm = LLM(source, sparsity="off")
    text = CALIBRATION.read_text()
    allocator = Allocator(calibration_of(llm, text, 1024, progress=False), progress=False)
    for target, method in ((0.3, "uniform"), (0.5, "blockwise")):
        plain, reused = tmp_path / f"plain-{method}.gguf", tmp_path / f"reused-{method}.gguf"
        # every site skipping: the pay-off rule's timings are not the question here
        sparsify(LLM(source, sparsity="off"), text, plain, Target(sparsity=target), n_tokens=1024, method=method,
                 progress=False, all_sites=True)
        write_sparsified(llm, allocator, reused, Target(sparsity=target), method, progress=False, all_sites=True)
        assert reused.read_bytes() == plain.read_bytes()


# ---------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def relu_model(tmp_path_factory, default_model) -> Path:
    folder = tmp_path_factory.mktemp("relu")
    make_tiny_llama(folder, "relu")
    Tokenizer.from_gguf(open_gguf(default_model)).backend.save(str(folder / "tokenizer.json"))
    return convert_each(folder, ("q8_0",))["q8_0"]


def test_sparsify_refuses_a_relu_model(relu_model, tmp_path):
    result = powerinfer("sparsify", "-m", str(relu_model), "-f", str(CALIBRATION), "-o", str(tmp_path / "out.gguf"))
    assert_one_line_error(result, "ReLU", "predictor")


@pytest.mark.parametrize("text", ["", "too short to calibrate on"])
def test_sparsify_refuses_an_empty_or_short_calibration_text(sparsified, tmp_path, text):
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(text)
    result = powerinfer("sparsify", "-m", str(sparsified[0]), "-f", str(calibration), "-o", str(tmp_path / "out.gguf"))
    assert_one_line_error(result, "calibration text too short")


@pytest.mark.parametrize("flags, message", [
    (["--target-sparsity", "1.5"], "--target-sparsity"),
    (["--target-sparsity", "lots"], "--target-sparsity"),
    (["--max-ppl-increase", "0.9"], "--max-ppl-increase"),
    (["--target-sparsity", "0.3", "--max-ppl-increase", "1.05"], "not allowed with"),
])
def test_sparsify_refuses_an_unknown_target(tmp_path, flags, message):
    result = powerinfer("sparsify", "-m", str(tmp_path / "never-read.gguf"), "-f", str(CALIBRATION),
                        "-o", str(tmp_path / "out.gguf"), *flags)
    assert_one_line_error(result, message)


def test_sparsify_keeps_an_existing_output(sparsified, tmp_path):
    output = tmp_path / "out.gguf"
    output.write_bytes(b"the user's file")
    result = powerinfer("sparsify", "-m", str(sparsified[0]), "-f", str(CALIBRATION), "-o", str(output))
    assert_one_line_error(result, "exists", "--force")
    assert output.read_bytes() == b"the user's file"


def test_sites_whose_skipping_does_not_pay_run_dense(tmp_path, default_model, monkeypatch, capsys):
    """Where this machine measures the rows faster at every sparsity, the file gets no thresholds
    (so --sparsity auto is never slower than dense) and sparsify says so in one line."""
    monkeypatch.setattr(sparsify_module, "BreakEven", lambda **_: BreakEven(lambda shape, working_set: NEVER))
    source = save_tiny(tmp_path, "llama", default_model)
    output = tmp_path / "sparse.gguf"
    sparsify(LLM(source, sparsity="off"), CALIBRATION.read_text(), output, Target(sparsity=0.5), n_tokens=1024,
             progress=False)
    names = {t.name for t in GGUFReader(output).tensors}
    assert names == {t.name for t in GGUFReader(source).tensors}
    assert "runs every linear dense" in capsys.readouterr().err


def test_the_quality_budget_goes_to_the_sites_that_pay(tmp_path, default_model, monkeypatch):
    """Where only the output head's skipping pays (its runs are a vocabulary long), sparsify spreads
    the target over the head alone: the file holds `output.thresholds` only, skipping the target's
    share of the head's channels, and decodes as its masked-dense form."""
    monkeypatch.setattr(sparsify_module, "BreakEven",
                        lambda **_: BreakEven(lambda shape, working_set: 0.1 if shape.rows[0][1] == VOCAB else NEVER))
    monkeypatch.setattr(sparsify_module, "decode_speedup", lambda *_, **__: 2.0)  # the timing is not the question
    source = save_tiny(tmp_path, "llama", default_model)
    output = tmp_path / "sparse.gguf"
    allocation = sparsify(LLM(source, sparsity="off"), CALIBRATION.read_text(), output, Target(sparsity=0.4),
                          n_tokens=1024, progress=False)
    names = {t.name for t in GGUFReader(output).tensors}
    assert names - {t.name for t in GGUFReader(source).tensors} == {HEAD + THRESHOLDS_SUFFIX}
    assert allocation.sites[HEAD].sparsity == pytest.approx(0.4)
    assert all(a.sparsity == 0 for name, a in allocation.sites.items() if name != HEAD)
    # what sparsify reports skipped: the share of the sites the file holds thresholds for
    assert sparse_sites(open_gguf(output)) == {HEAD}
    assert allocation.sparsity_at({HEAD}) == allocation.sparsity > allocation.sparsity_at(set()) == 0
    sparse, dense = LLM(output), LLM(output, sparsity="off")
    ids = sparse.tokenize(PROMPT)[:12]
    thresholds = {HEAD: torch.from_numpy(np.array(open_gguf(output).tensor(HEAD + THRESHOLDS_SUFFIX).data, dtype=np.float32))}
    with masked(model_sites(dense.model), thresholds):
        expected = decode_logits(dense, ids)
    assert (decode_logits(sparse, ids) - expected).abs().max() < 1e-2 * expected.abs().max()


@pytest.mark.parametrize("down_pays_from", ["at its shared share", "only alone"])
def test_sites_short_of_their_break_even_leave_the_budget_to_the_others(tmp_path, default_model, down_pays_from):
    """Within a perplexity budget, a site whose share falls short of its break-even would spend
    quality and still run dense: it leaves, and the budget is spread again over the sites that pay
    (where none pays, the sites of the highest break-even leave first)."""
    source = save_tiny(tmp_path, "llama", default_model)
    calibration = calibration_of(LLM(source, sparsity="off"), CALIBRATION.read_text(), 1024, progress=False)
    blocks = [s for s in calibration.sites if s.layer is not None]  # masking this random model's head helps it
    down = [s.name for s in blocks if s.kind == "ffn_down"]
    down_in = {s.in_features for s in blocks if s.kind == "ffn_down"}
    assert len(down_in) == 1 and all(s.in_features not in down_in for s in blocks if s.kind != "ffn_down")
    allocator = Allocator(calibration, progress=False, taking_part=[s.name for s in blocks])
    target = Target(max_ppl_increase=1.01)  # within 1.02 this random model's sites all reach the search's top
    shared = target.allocate(allocator, "uniform").sites[down[0]].sparsity
    alone = target.allocate(allocator.among(down), "uniform")
    assert 0 < shared < alone.sites[down[0]].sparsity  # the budget the other sites spent
    pays_from = shared / 2 if down_pays_from == "at its shared share" else (shared + alone.sites[down[0]].sparsity) / 2
    break_even = BreakEven(lambda shape, working_set: pays_from if shape.in_features in down_in else NEVER)
    allocation, paying = allocate_where_it_pays(allocator, target, "uniform", break_even)
    assert [s.name for s in paying] == down
    assert {n: a.sparsity for n, a in allocation.sites.items()} == {n: a.sparsity for n, a in alone.sites.items()}


@pytest.mark.parametrize("speedup", [1.25, 1.0])
def test_a_file_that_decodes_no_faster_than_its_source_is_written_dense(tmp_path, default_model, monkeypatch, capsys,
                                                                      speedup):
    """Sites that pay alone must also pay together: sparsify decodes the file it would write against
    its source (here a stand-in reports the measurement) and, below DECODE_MARGIN, writes it dense and
    says so in one line. The candidate is the output's own temporary file: nothing else is left."""
    monkeypatch.setattr(sparsify_module, "BreakEven",
                        lambda **_: BreakEven(lambda shape, working_set: 0.1 if shape.rows[0][1] == VOCAB else NEVER))
    measured = []

    def decode_speedup(sparse, dense, prompt, progress):
        measured.append((sparse_sites(open_gguf(sparse.path)), dense.sparsity, len(prompt)))
        return speedup

    monkeypatch.setattr(sparsify_module, "decode_speedup", decode_speedup)
    source = save_tiny(tmp_path, "llama", default_model)
    output = tmp_path / "out" / "sparse.gguf"
    output.parent.mkdir()
    capsys.readouterr()  # what making the model printed
    sparsify(LLM(source, sparsity="off"), CALIBRATION.read_text(), output, Target(sparsity=0.4), n_tokens=1024,
             progress=False)
    assert measured == [({HEAD}, "off", PROMPT_TOKENS)]  # the candidate: the head skipping, against the dense source
    assert sorted(p.name for p in output.parent.iterdir()) == ["sparse.gguf"]
    written = sparse_sites(open_gguf(output))
    # the file is the source plus the thresholds kept (the candidate's writing left the source whole)
    assert {t.name for t in GGUFReader(output).tensors} == ({t.name for t in GGUFReader(source).tensors}
                                                            | {s + THRESHOLDS_SUFFIX for s in written})
    err = capsys.readouterr().err
    if speedup >= DECODE_MARGIN:
        assert written == {HEAD} and "dense" not in err
    else:
        assert written == set()
        assert "decoded at 1.00x" in err and "runs every linear dense" in err and len(err.strip().splitlines()) == 1
