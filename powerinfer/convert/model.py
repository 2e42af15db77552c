"""Write a model from any source (Hugging Face folder, GGUF, PowerInfer GGUF) as GGUF, or as
PowerInfer GGUF when predictors are given.

PowerInfer GGUF (DESIGN.md): magic `PWRI`; per layer `blk.N.fc1.weight` [R, n_embd] and
`blk.N.fc2.weight` [n_ff, R] (the predictor: F16 as PowerInfer's converter writes it, Q4_0 after its quantize);
`blk.N.ffn_down_t.weight` [n_ff, n_embd] (one row per neuron) instead of `ffn_down` (and
`ffn_down_t.bias` instead of `ffn_down.bias`);
`powerinfer.sparse_threshold`. Our extra keys: per-layer score thresholds and, for SiLU/GELU
models, the |activation| thresholds that defined "fired" when the predictors were trained.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, quants
from tqdm import tqdm

from powerinfer.config import ACTIVATION_KEY
from powerinfer.convert.encode import FILE_TYPES, encode_tensor
from powerinfer.convert.mixes import Mix, ModelFacts
from powerinfer.errors import PowerInferError
from powerinfer.gguf.reader import GGUFTensor, open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.models import read_config
from powerinfer.sparse.ffn import ACTIVATION_THRESHOLDS_KEY
from powerinfer.sparse.predictor import LAYER_THRESHOLDS_KEY, PREDICTED_SPARSITY_KEY, SPARSE_THRESHOLD_KEY
from powerinfer.sparse.predictor_training import PredictorDirectory

T = GGMLQuantizationType
_FFN_DOWN = re.compile(r"blk\.(\d+)\.ffn_down\.weight")
_FFN_DOWN_BIAS = re.compile(r"blk\.\d+\.ffn_down\.bias")
_PREDICTOR = re.compile(r"blk\.\d+\.fc[12]\.weight")
_PREDICTOR_KEYS = {SPARSE_THRESHOLD_KEY, LAYER_THRESHOLDS_KEY, ACTIVATION_THRESHOLDS_KEY, PREDICTED_SPARSITY_KEY}

TypedValue = tuple[Any, GGUFValueType, GGUFValueType | None]


@dataclass
class ModelSource:
    """What a converter reads: metadata and tensors (float32 arrays, or tensors of a GGUF file)."""

    origin: Path
    architecture: str
    metadata: dict[str, Any]  # plain Python values; types chosen on writing
    typed_metadata: dict[str, TypedValue]  # values with their exact GGUF types (from a GGUF source)
    tensors: Iterator[tuple[str, np.ndarray | GGUFTensor]]
    n_layers: int
    n_embd: int
    n_ff: int
    has_predictors: bool = False
    facts: ModelFacts | None = None  # what quantization mixes look at (GGUF sources)


def gguf_source(path: str | Path) -> ModelSource:
    """A GGUF or PowerInfer GGUF file as a conversion source; metadata keep their exact types."""
    gguf = open_gguf(path)  # validates the file with one-line errors
    typed: dict[str, TypedValue] = {name: (value, *gguf.value_types[name]) for name, value in gguf.metadata.items()
                                    if name != "general.architecture"}
    arch = gguf.require("general.architecture")
    n_layers, n_embd, n_ff = (int(gguf.require(f"{arch}.{k}")) for k in ("block_count", "embedding_length", "feed_forward_length"))
    n_head, n_head_kv = gguf.get(f"{arch}.attention.head_count"), gguf.get(f"{arch}.attention.head_count_kv")
    facts = ModelFacts(arch, n_layers, tied_embeddings="output.weight" not in gguf.tensors,
                       n_expert=int(gguf.get(f"{arch}.expert_count") or 1),
                       llama_70b=arch == "llama" and n_layers == 80 and n_head_kv is not None and n_head != n_head_kv)
    # The activation as this file implies it, stored explicitly: a llama GGUF without the key is
    # SiLU, but a PowerInfer GGUF without it would read as ReLU-Llama.
    metadata = {} if ACTIVATION_KEY in typed else {ACTIVATION_KEY: read_config(gguf).activation.value}
    return ModelSource(gguf.path, arch, metadata, typed, iter(gguf.tensors.items()), n_layers, n_embd, n_ff,
                       has_predictors="blk.0.fc1.weight" in gguf.tensors, facts=facts)


def _float(tensor: np.ndarray | GGUFTensor) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return tensor
    return quants.dequantize(tensor.data, tensor.ggml_type).reshape(tensor.shape).astype(np.float32, copy=False)


def encode_source(name: str, tensor: np.ndarray | GGUFTensor, outtype: T | None) -> TensorData:
    """`tensor` as `outtype` (None: a GGUF tensor keeps its type, a float array becomes F16)."""
    if isinstance(tensor, GGUFTensor) and (outtype is None or outtype == tensor.ggml_type or len(tensor.shape) == 1):
        data = tensor.data if tensor.ggml_type in (T.F32, T.F16) else tensor.rows_as_bytes()
        return TensorData(name, data, tensor.ggml_type)
    return encode_tensor(name, _float(tensor), T.F16 if outtype is None else outtype)  # T.F32 is 0: no `or`


def _down_t_type(down: np.ndarray | GGUFTensor) -> T | None:
    """ffn_down_t's type when the caller keeps the source's: a 4-bit ffn_down is re-encoded as
    Q8_0, since its blocks run along the other axis and a second 4-bit rounding would add error."""
    if not isinstance(down, GGUFTensor):
        return None
    return T.Q8_0 if down.ggml_type in (T.Q4_0, T.Q4_1) else down.ggml_type


def _chosen_type(name: str, shape: tuple[int, ...], outtype: T | Mix | None, facts: ModelFacts | None) -> T | None:
    """The type to write tensor `name` as (None: a GGUF tensor keeps its type, a float array becomes
    F16). A single type leaves the predictors as they are; a mix decides for every matrix."""
    if isinstance(outtype, Mix):
        if facts is None:
            raise PowerInferError("quantization mixes need a GGUF source")
        return outtype.matrix_type(name, shape[-1], facts) if len(shape) > 1 else None
    return None if _PREDICTOR.fullmatch(name) else outtype


def _predictor_tensors(layer: int, predictors: PredictorDirectory, outtype: T | Mix | None,
                       facts: ModelFacts | None) -> Iterator[TensorData]:
    for name, weight in ((f"blk.{layer}.fc1.weight", predictors.fc1[layer]), (f"blk.{layer}.fc2.weight", predictors.fc2[layer])):
        array = weight.float().numpy()
        yield encode_source(name, array, _chosen_type(name, array.shape, outtype, facts))


def _output_tensors(source: ModelSource, outtype: T | Mix | None, predictors: PredictorDirectory | None,
                    progress: bool) -> Iterator[TensorData]:
    """The source's tensors re-encoded; with predictors, ffn_down transposed to ffn_down_t and each
    layer's predictor added."""
    for name, tensor in tqdm(source.tensors, desc="converting", unit="tensor", disable=None if progress else True, file=sys.stderr):
        if predictors is not None and _PREDICTOR.fullmatch(name):
            continue  # replaced by the new predictors
        down = _FFN_DOWN.fullmatch(name)
        if predictors is not None and down:
            layer = int(down.group(1))
            down_t = np.ascontiguousarray(_float(tensor).T)
            down_t_name = f"blk.{layer}.ffn_down_t.weight"
            chosen = _down_t_type(tensor) if outtype is None else _chosen_type(down_t_name, down_t.shape, outtype, source.facts)
            yield encode_source(down_t_name, down_t, chosen)
            yield from _predictor_tensors(layer, predictors, outtype, source.facts)
            continue
        if predictors is not None and _FFN_DOWN_BIAS.fullmatch(name):
            name = name.replace(".ffn_down.", ".ffn_down_t.")  # PowerInfer's name for it (OPT)
        yield encode_source(name, tensor, _chosen_type(name, tuple(tensor.shape), outtype, source.facts))


def write_model(source: ModelSource, outfile: str | Path, outtype: T | Mix | None = None,
                predictors: PredictorDirectory | None = None, progress: bool = True, replace: bool = True) -> None:
    """Write `source` to `outfile` (atomically; over an existing file only when `replace`): GGUF, or
    PowerInfer GGUF with `predictors`. `outtype`: one type for every matrix but the predictors, a
    quantization mix, or None to keep the source's types."""
    metadata, typed = dict(source.metadata), dict(source.typed_metadata)
    if outtype is not None:
        typed.pop("general.file_type", None)
        metadata["general.file_type"] = int(outtype.file_type if isinstance(outtype, Mix) else FILE_TYPES[outtype])
    if predictors is not None:
        predictors.check_matches(source.n_layers, source.n_embd, source.n_ff, str(source.origin))
        for key in _PREDICTOR_KEYS:
            typed.pop(key, None)
        metadata[SPARSE_THRESHOLD_KEY] = float(predictors.sparse_threshold)
        if predictors.layer_thresholds is not None:
            metadata[LAYER_THRESHOLDS_KEY] = [float(t) for t in predictors.layer_thresholds]
        if predictors.activation_thresholds is not None:
            metadata[ACTIVATION_THRESHOLDS_KEY] = [float(t) for t in predictors.activation_thresholds]
        if predictors.predicted_sparsity is not None:
            metadata[PREDICTED_SPARSITY_KEY] = [float(s) for s in predictors.predicted_sparsity]
    write_gguf(outfile, source.architecture, metadata, _output_tensors(source, outtype, predictors, progress),
               powerinfer=predictors is not None or source.has_predictors, typed_metadata=typed, replace=replace)
