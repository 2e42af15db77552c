"""`powerinfer sparsify`: training-free input sparsity for every linear of every block, and the head.

Calibrates the inputs of every site (each block's four, and the output head's) on a text
(calibrate.py), spreads a model-level target across the sites whose skipping pays on this machine
(allocate.py; payoff.py measures where), and writes a GGUF in which each site whose share pays gets
its thresholds (storage.py); the other sites run dense. The quality budget of `--max-ppl-increase`
is thus spent only where skipping saves time. Every tensor and key of the source is copied as it
is: the weights keep their rows and their type (no re-quantization).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from powerinfer.convert.model import ModelSource, encode_source, gguf_source
from powerinfer.errors import PowerInferError, UnsupportedModelError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf_at
from powerinfer.llm import LLM
from powerinfer.ops.quant import T
from powerinfer.outputs import atomic_file, check_output_file, warn
from powerinfer.sparse.allocate import Allocation, Allocator, Method
from powerinfer.sparse.calibrate import DEFAULT_CHUNK, DEFAULT_TOKENS, Calibration, calibrate, calibration_chunks
from powerinfer.sparse.columns import runs_take
from powerinfer.sparse.payoff import DECODE_MARGIN, BreakEven, LinearShape, decode_speedup
from powerinfer.sparse.sites import Site
from powerinfer.sparse.storage import TARGET_KEY, THRESHOLDS_SUFFIX, is_sparsified

DEFAULT_MAX_PPL_INCREASE = 1.02  # on the calibration text; the held-out increase measures a little higher
# A site takes part in the allocation when its channel runs beat its rows at this sparsity or less:
# one that pays only beyond it would spend the quality budget for little time.
PAYING_BY = 0.5
PROMPT_TOKENS = 8  # of the first calibration chunk: the prompt the decode speed-up is measured after

@dataclass(frozen=True)
class Target:
    """What to aim for: a model-level sparsity, or the largest one within a perplexity increase."""

    sparsity: float | None = None
    max_ppl_increase: float | None = None

    def allocate(self, allocator: Allocator, method: Method) -> Allocation:
        if self.sparsity is not None:
            return allocator.allocate(self.sparsity, method)
        return allocator.within_perplexity(self.max_ppl_increase or DEFAULT_MAX_PPL_INCREASE, method)


def sparsify(llm: LLM, text: str, output: str | os.PathLike[str], target: Target = Target(), force: bool = False,
             n_tokens: int | None = DEFAULT_TOKENS, method: Method = "measured", progress: bool = True,
             all_sites: bool = False) -> Allocation:
    """Write `output`: `llm`'s file (loaded dense) sparsified on the calibration `text`, the target
    spread across sites by `method` (allocate.py); returns the allocation it holds. A site gets
    thresholds only where this machine decodes it faster skipping (payoff.py), unless `all_sites`
    (every site that skips channels: a file for another CPU, or to measure quality)."""
    check_output_file(output, force)
    calibration = calibration_of(llm, text, n_tokens, progress)
    break_even = None if all_sites else model_break_even(calibration.sites)
    allocator = Allocator(calibration, progress=progress, taking_part=taking_part(calibration.sites, break_even, progress))
    return write_sparsified(llm, allocator, output, target, method, force, progress, all_sites, break_even)


def model_break_even(sites: list[Site]) -> BreakEven:
    """Break-evens timed with copies of each linear rotating through the model's weights (all its
    sites' linears: what a decode step reads)."""
    return BreakEven(working_set=sum(s.linear.nbytes for s in sites))


def taking_part(sites: list[Site], break_even: BreakEven | None, progress: bool = True) -> list[str]:
    """The names of the sites of a type that channel runs take and, given `break_even`, whose runs
    beat their rows by PAYING_BY skipped (the sites the allocation spreads the target over)."""
    runs = [s for s in sites if runs_take([t.ggml_type for t in s.linear.sources])]
    if break_even is not None:
        runs = [s for s in tqdm(runs, desc="measuring where skipping pays", unit="site", disable=not progress)
                if break_even.pays(_shape(s), PAYING_BY)]
    return [s.name for s in runs]


def calibration_of(llm: LLM, text: str, n_tokens: int | None = DEFAULT_TOKENS, progress: bool = True) -> Calibration:
    """The sites of `llm` (loaded dense) calibrated on `text`: what `sparsify` measures before it
    allocates, to be reused by several `write_sparsified` calls (one calibration, many targets)."""
    _check_model(llm)
    tokenizer = llm.tokenizer
    # chunks as long as perplexity's (or the context, if shorter): the statistics of long-range positions
    chunks = calibration_chunks(tokenizer.encode(text, add_bos=False), tokenizer.bos_id if tokenizer.add_bos else None,
                                n_tokens, min(DEFAULT_CHUNK, llm.n_ctx))
    return calibrate(llm.model, chunks, progress=progress)


def write_sparsified(llm: LLM, allocator: Allocator, output: str | os.PathLike[str], target: Target = Target(),
                     method: Method = "measured", force: bool = False, progress: bool = True,
                     all_sites: bool = False, break_even: BreakEven | None = None) -> Allocation:
    """Write `output`: `llm`'s file sparsified by the allocation `target` and `method` give on the
    calibration of `allocator` (of `llm`'s own model: calibration_of), sites chosen as `sparsify`
    says (`break_even`: its measurements so far), and written dense unless it then decodes
    DECODE_MARGIN times as fast as `llm` (unless `all_sites`); returns that allocation."""
    check_output_file(output, force)
    _check_model(llm)
    calibration = allocator.calibration
    allocation, paying = allocate_where_it_pays(allocator, target, method,
                                                None if all_sites else break_even or model_break_even(calibration.sites))
    if not paying:
        _warn_dense(f"no site of {llm.path.name} decodes faster skipping channels on this CPU at these sparsities", output)
    with atomic_file(output, force) as tmp:
        _write(llm, tmp, allocation, paying, progress)
        if paying and not all_sites:
            # the file decoded against its source before it appears
            speedup = decode_speedup(LLM(tmp, n_ctx=llm.n_ctx), llm, calibration.chunks[0][:PROMPT_TOKENS], progress=progress)
            if speedup < DECODE_MARGIN:
                _warn_dense(f"skipping channels decoded at {speedup:.2f}x {llm.path.name} on this CPU (measured)", output)
                os.unlink(tmp)  # a new file: the measured model's mapping keeps the old one's pages
                _write(llm, tmp, allocation, [], progress)
    return allocation


def _warn_dense(why: str, output: str | os.PathLike[str]) -> None:
    warn(f"{why}: {Path(output).name} runs every linear dense (--all-sites gives every site its thresholds anyway)")


def _write(llm: LLM, path: Path, allocation: Allocation, paying: list[Site], progress: bool) -> None:
    """`llm`'s file, every tensor and key as it is, plus the thresholds of the sites `paying`, at `path`."""
    source = gguf_source(llm.path)
    metadata = {**source.metadata, TARGET_KEY: float(allocation.sparsity)}
    write_gguf_at(path, source.architecture, metadata, _sparsified_tensors(source, paying, allocation),
                  typed_metadata=source.typed_metadata, progress=progress)


def _check_model(llm: LLM) -> None:
    gguf_path = llm.path
    if llm.config.activation.is_relu_family:
        raise UnsupportedModelError(f"{gguf_path}: a ReLU-family model is sparse in its FFN already: use the predictor "
                                    "flow (powerinfer profile, train-predictors, convert --predictors)")
    if llm.config.n_expert:
        raise UnsupportedModelError(f"{gguf_path}: mixtures of experts cannot be sparsified yet")
    if is_sparsified(open_gguf(gguf_path)):
        raise PowerInferError(f"{gguf_path}: is sparsified already; sparsify its dense source")


def _shape(site: Site) -> LinearShape:
    return LinearShape(site.in_features, tuple((t.ggml_type, t.shape[0]) for t in site.linear.sources))


def allocate_where_it_pays(allocator: Allocator, target: Target, method: Method,
                           break_even: BreakEven | None) -> tuple[Allocation, list[Site]]:
    """The allocation of `target` by `method`, and the sites that skip channels in it in a type that
    channel runs take and, given `break_even`, skip enough to pay on this machine.

    A site takes part when its runs pay by PAYING_BY, but its share of a perplexity budget may fall
    short of its break-even: it would then spend quality and run dense. Such sites leave, and the
    target is spread again over the rest, until every site left pays; where none does, the sites of
    the highest break-even leave. (Gemma 3 270M on an Intel Xeon: nine Q6_K down inputs, break-even
    0.39, took part beside the head, 0.23; within 1.02x perplexity every site got 0.21, so none paid
    and the file ran dense.)"""
    while True:
        allocation = target.allocate(allocator, method)
        skipping = [s for s in allocator.sites if allocation.sites[s.name].sparsity > 0
                    and runs_take([t.ggml_type for t in s.linear.sources])]
        if break_even is None:
            return allocation, skipping
        paying = [s for s in skipping if break_even.pays(_shape(s), allocation.sites[s.name].sparsity)]
        if len(paying) == len(skipping):
            return allocation, paying
        staying = paying
        if not paying:  # the sites of the highest break-even leave
            highest = max(break_even(_shape(s)) for s in skipping)
            staying = [s for s in skipping if break_even(_shape(s)) < highest]
            if not staying:
                return allocation, []
        allocator = allocator.among([s.name for s in staying])


def _sparsified_tensors(source: ModelSource, paying: list[Site], allocation: Allocation) -> Iterator[TensorData]:
    for name, tensor in source.tensors:
        yield encode_source(name, tensor, None)
    for site in paying:
        yield TensorData(site.name + THRESHOLDS_SUFFIX, allocation.sites[site.name].thresholds.numpy().astype(np.float32), T.F32)
