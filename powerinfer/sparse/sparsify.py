"""`powerinfer sparsify`: training-free input sparsity for every linear of every block.

Calibrates the inputs of each block's four sites on a text (calibrate.py), spreads a model-level
target across layers and sites (allocate.py), and writes a GGUF in which each site whose share
pays is stored by columns with its thresholds (storage.py); the other sites stay as they were and
run dense. Everything else of the source (tokenizer, head, norms, metadata) is copied as it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from tqdm import tqdm

from powerinfer.convert.encode import encode_tensor
from powerinfer.convert.model import ModelSource, encode_source, gguf_source
from powerinfer.errors import PowerInferError, UnsupportedModelError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.reader import GGUFTensor
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.llm import LLM
from powerinfer.ops.linear import dequantized
from powerinfer.ops.quant import T
from powerinfer.outputs import check_output_file, warn
from powerinfer.sparse.allocate import Allocation, Allocator, Method
from powerinfer.sparse.calibrate import DEFAULT_CHUNK, DEFAULT_TOKENS, calibrate, calibration_chunks
from powerinfer.sparse.payoff import BreakEven, LinearShape
from powerinfer.sparse.sites import Site
from powerinfer.sparse.storage import TARGET_KEY, THRESHOLDS_SUFFIX, columns_name, is_sparsified

DEFAULT_MAX_PPL_INCREASE = 1.02  # on the calibration text; the held-out increase measures a little higher

# The block type of a column layout by the source's type: the same where the outputs split into its
# blocks, else the nearest 32-value type (Q4_K columns of 576 outputs do not split into 256s).
COLUMN_TYPES = {T.Q4_0: T.Q4_0, T.Q4_1: T.Q4_1, T.Q5_0: T.Q5_0, T.Q5_1: T.Q5_1, T.Q8_0: T.Q8_0,
                T.Q4_K: T.Q4_K, T.Q5_K: T.Q5_K, T.Q6_K: T.Q6_K}
COLUMN_FALLBACK = {T.Q4_K: T.Q4_1, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
FLOAT_SOURCE_COLUMNS = T.Q8_0  # a float file's sparsified linears (a 4-bit rounding would change the model)


@dataclass(frozen=True)
class Target:
    """What to aim for: a model-level sparsity, or the largest one within a perplexity increase."""

    sparsity: float | None = None
    max_ppl_increase: float | None = None

    def allocate(self, allocator: Allocator, method: Method) -> Allocation:
        if self.sparsity is not None:
            return allocator.allocate(self.sparsity, method)
        return allocator.within_perplexity(self.max_ppl_increase or DEFAULT_MAX_PPL_INCREASE, method)


def column_type(source: T, out_features: int) -> T:
    """The block type a linear's columns are stored in (see COLUMN_TYPES)."""
    chosen = COLUMN_TYPES.get(source, FLOAT_SOURCE_COLUMNS)
    if out_features % GGML_QUANT_SIZES[chosen][0]:
        chosen = COLUMN_FALLBACK.get(chosen, T.Q8_0)
    return chosen


def sparsify(llm: LLM, text: str, output: str | os.PathLike[str], target: Target = Target(), force: bool = False,
             n_tokens: int | None = DEFAULT_TOKENS, method: Method = "blockwise", progress: bool = True,
             all_sites: bool = False) -> Allocation:
    """Write `output`: `llm`'s file (loaded dense) sparsified on the calibration `text`, the target
    spread across sites by `method` (allocate.py); returns the allocation it holds. A site is stored
    by columns only where this machine decodes it faster that way (payoff.py), unless `all_sites`
    (every site that skips channels: a file for another CPU, or to measure quality)."""
    check_output_file(output, force)
    _check_model(llm)
    tokenizer = llm.tokenizer
    # chunks as long as perplexity's (or the context, if shorter): the statistics of long-range positions
    chunks = calibration_chunks(tokenizer.encode(text, add_bos=False), tokenizer.bos_id if tokenizer.add_bos else None,
                                n_tokens, min(DEFAULT_CHUNK, llm.n_ctx))
    calibration = calibrate(llm.model, chunks, progress=progress)
    allocation = target.allocate(Allocator(calibration, progress=progress), method)
    paying = _stored_by_columns(calibration.sites, allocation, None if all_sites else BreakEven(), progress)
    if not paying:
        warn(f"no site of {llm.path.name} decodes faster by columns on this CPU at these sparsities: {Path(output).name} "
             "keeps every linear by rows (--all-sites stores them by columns anyway)")
    source = gguf_source(llm.path)
    metadata = {**source.metadata, TARGET_KEY: float(allocation.sparsity)}
    write_gguf(output, source.architecture, metadata, _sparsified_tensors(source, paying, allocation),
               typed_metadata=source.typed_metadata, progress=progress, replace=force)
    return allocation


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
    tensors = site.linear.sources
    return LinearShape(site.in_features, tuple((t.ggml_type, t.shape[0]) for t in tensors),
                       tuple(column_type(t.ggml_type, t.shape[0]) for t in tensors))


def _stored_by_columns(sites: list[Site], allocation: Allocation, break_even: BreakEven | None,
                       progress: bool) -> list[Site]:
    """The sites that skip channels and, given `break_even`, skip enough to pay on this machine."""
    skipping = [s for s in sites if allocation.sites[s.name].sparsity > 0]
    if break_even is None:
        return skipping
    return [s for s in tqdm(skipping, desc="measuring where columns pay", unit="site", disable=not progress)
            if break_even.pays(_shape(s), allocation.sites[s.name].sparsity)]


def _site_tensors(sites: list[Site]) -> dict[str, str]:
    """Weight name -> the site whose input it reads, for the linears to store by columns."""
    names = {}
    for site in sites:
        for tensor in site.linear.sources:
            names[tensor.name] = site.name
    return names


def _sparsified_tensors(source: ModelSource, paying: list[Site], allocation: Allocation) -> Iterator[TensorData]:
    by_columns = _site_tensors(paying)
    for name, tensor in source.tensors:
        if name not in by_columns:
            yield encode_source(name, tensor, None)
            continue
        yield _columns(name, tensor)
        site = by_columns.pop(name)
        if site not in by_columns.values():  # the site's last tensor: its thresholds follow
            yield TensorData(site + THRESHOLDS_SUFFIX, allocation.sites[site].thresholds.numpy().astype(np.float32), T.F32)


def _columns(name: str, tensor: GGUFTensor) -> TensorData:
    """The transpose of a weight [out, in], one row per input channel (see column_type)."""
    out_features = tensor.shape[0]
    return encode_tensor(columns_name(name), dequantized(tensor).T.contiguous().numpy(),
                         column_type(tensor.ggml_type, out_features))
