"""PowerInfer's GPU index: which neurons of each layer live on the accelerator.

`<model file>.generated.gpuidx` next to the model (PowerInfer names it after the whole file name):
a GGUF with the PWRI magic, architecture `generic.gpu_index`, `generic.gpu_index.block_count`,
`split.vram_capacity` (u64: the neuron budget in bytes the index was made for), and per layer, in
this order, `blk.N.gpu_idx` (I32 [n_ff], 1 = on the accelerator) and `blk.N.gpu_bucket` (I32, the
sorted ids of those neurons). A file is never trusted: every id is checked against the model.

I32 is written with type code 18, PowerInfer's ggml numbering (before the IQ types took 16-23),
which its loader reads; the `gguf` package calls I32 26, and PowerInfer's loader divides by a zero
block size on that. Both codes are read.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from powerinfer.errors import ModelFileError, PowerInferError
from powerinfer.gguf.reader import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.placement.solver import Plan

ARCHITECTURE = "generic.gpu_index"
CAPACITY_KEY = "split.vram_capacity"
BLOCK_COUNT_KEY = f"{ARCHITECTURE}.block_count"
SUFFIX = ".generated.gpuidx"
POWERINFER_I32 = 18  # I32's type code in PowerInfer's ggml (the gguf package's 18 is IQ3_XXS)


class StaleIndexError(PowerInferError):
    """A GPU index that does not belong to this model, or is internally inconsistent."""


def index_path(model: str | os.PathLike[str]) -> Path:
    model = Path(model)
    return model.with_name(model.name + SUFFIX)


def write_gpu_index(path: str | os.PathLike[str], plan: Plan, replace: bool = True) -> None:
    """Write the plan's placement (atomically: a reader never sees half a file; an existing file
    is replaced only when `replace`)."""
    tensors = []
    for i, (hot, n_ff) in enumerate(zip(plan.hot, plan.n_ff)):
        flags = np.zeros(n_ff, dtype=np.int32)
        flags[hot] = 1
        tensors += [TensorData(f"blk.{i}.gpu_idx", flags, GGMLQuantizationType.I32, POWERINFER_I32),
                    TensorData(f"blk.{i}.gpu_bucket", np.sort(hot).astype(np.int32), GGMLQuantizationType.I32,
                               POWERINFER_I32)]
    write_gguf(path, ARCHITECTURE, {BLOCK_COUNT_KEY: len(plan.hot)}, tensors, powerinfer=True,
               typed_metadata={CAPACITY_KEY: (int(plan.capacity), GGUFValueType.UINT64, None)}, replace=replace)


def read_gpu_index(path: str | os.PathLike[str], n_ff: tuple[int, ...]) -> tuple[tuple[np.ndarray, ...], int]:
    """(sorted hot ids per layer, stored capacity in bytes) of an index made for a model with these
    layer widths. Raises `ModelFileError` for an unreadable file, `StaleIndexError` for one that
    does not match the model or contradicts itself."""
    index = open_gguf(path, type_codes={POWERINFER_I32: GGMLQuantizationType.I32})
    if index.get("general.architecture") != ARCHITECTURE:
        raise StaleIndexError(f"{path}: not a GPU index (architecture {index.get('general.architecture')!r})")
    layers, capacity = index.get(BLOCK_COUNT_KEY), index.get(CAPACITY_KEY)
    if not isinstance(capacity, int) or capacity < 0:
        raise StaleIndexError(f"{path}: {CAPACITY_KEY} is missing or invalid")
    if layers != len(n_ff) or len(index.tensors) != 2 * len(n_ff):
        raise StaleIndexError(f"{path}: made for {layers} layers, the model has {len(n_ff)}")
    hot = []
    for i, width in enumerate(n_ff):
        flags, bucket = (index.tensors.get(f"blk.{i}.{name}") for name in ("gpu_idx", "gpu_bucket"))
        if flags is None or bucket is None or {flags.ggml_type, bucket.ggml_type} != {GGMLQuantizationType.I32}:
            raise StaleIndexError(f"{path}: layer {i} lacks I32 gpu_idx/gpu_bucket tensors")
        flags, bucket = np.asarray(flags.data).ravel(), np.asarray(bucket.data).ravel().astype(np.int32)
        if len(flags) != width:
            raise StaleIndexError(f"{path}: layer {i} has {len(flags)} neurons, the model {width}")
        if len(bucket) and (bucket[0] < 0 or bucket[-1] >= width or np.any(np.diff(bucket) <= 0)):
            raise StaleIndexError(f"{path}: layer {i}'s gpu_bucket is not sorted unique ids below {width}")
        expected = np.zeros(width, dtype=flags.dtype)
        expected[bucket] = 1
        if not np.array_equal(flags, expected):
            raise StaleIndexError(f"{path}: layer {i}'s gpu_idx and gpu_bucket disagree")
        hot.append(bucket.copy())  # copied out of the mapping, which then closes
    return tuple(hot), capacity


def load_gpu_index(path: Path, n_ff: tuple[int, ...], warn) -> tuple[tuple[np.ndarray, ...], int] | None:
    """The index at `path` if it exists and is sound; a bad one is reported through `warn` (one
    line) and treated as absent, to be rebuilt."""
    if not path.exists():
        return None
    try:
        return read_gpu_index(path, n_ff)
    except ModelFileError as error:  # StaleIndexError is no ModelFileError: say which it was
        warn(f"ignoring corrupt GPU index ({error}); rebuilding it")
    except StaleIndexError as error:
        warn(f"ignoring stale GPU index ({error}); rebuilding it")
    return None
