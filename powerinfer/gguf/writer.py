"""Write GGUF and PowerInfer GGUF files with `gguf.GGUFWriter`, atomically."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from powerinfer.gguf.reader import PWRI_MAGIC
from powerinfer.outputs import atomic_file


@dataclass(frozen=True)
class TensorData:
    """A tensor ready to write: plain arrays (F32, F16, I32) as they are, other types as uint8 blocks
    [rows, bytes per row] from `gguf.quants.quantize`. `type_code` replaces the code written for
    the type where the file's reader numbers types unlike the `gguf` package (PowerInfer's I32 is 18)."""

    name: str
    data: np.ndarray
    ggml_type: GGMLQuantizationType
    type_code: int | None = None


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if 0 <= value < 2**32 else writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"cannot store {type(value).__name__} under {key}")


def write_gguf(path: str | os.PathLike[str], architecture: str, metadata: dict[str, Any],
               tensors: Iterable[TensorData], powerinfer: bool = False,
               typed_metadata: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] | None = None,
               progress: bool = False, replace: bool = True) -> None:
    """Write a GGUF file (magic `PWRI` when `powerinfer`) that appears at `path` only when complete
    (replacing an existing file only when `replace`)."""
    with atomic_file(path, replace) as tmp:
        write_gguf_at(tmp, architecture, metadata, tensors, powerinfer, typed_metadata, progress)


def write_gguf_at(path: str | os.PathLike[str], architecture: str, metadata: dict[str, Any],
                  tensors: Iterable[TensorData], powerinfer: bool = False,
                  typed_metadata: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] | None = None,
                  progress: bool = False) -> None:
    """Write a GGUF file straight at `path`, for a caller that makes it appear atomically itself
    (`outputs.atomic_file`)."""
    writer = GGUFWriter(path, architecture)
    for key, value in metadata.items():
        _add_value(writer, key, value)
    for key, (value, vtype, sub_type) in (typed_metadata or {}).items():
        writer.add_key_value(key, value, vtype, sub_type)
    for t in tensors:
        # the writer packs raw_dtype as the type code, and sizes plain (non-uint8) arrays by themselves
        raw_dtype = t.type_code if t.type_code is not None else t.ggml_type if t.data.dtype == np.uint8 else None
        writer.add_tensor(t.name, t.data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=progress)
    writer.close()
    if powerinfer:
        with open(path, "r+b") as f:
            f.write(PWRI_MAGIC.to_bytes(4, "little"))
