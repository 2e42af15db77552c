"""Open GGUF and PowerInfer GGUF (magic `PWRI`) files, memory-mapped.

The `gguf` package does the parsing; this module adds the PowerInfer magic, turns every way a
file can be broken into one `ModelFileError`, and gives typed access to metadata and tensors.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.constants import GGUF_MAGIC

from powerinfer.errors import ModelFileError

# PowerInfer GGUF files are GGUF with another magic: the bytes "PWRI" read as a little-endian u32.
PWRI_MAGIC = int.from_bytes(b"PWRI", "little")
MAGICS = {GGUF_MAGIC: "GGUF", PWRI_MAGIC: "PWRI"}


class _MagicTolerantReader(GGUFReader):
    """`GGUFReader` that also accepts the PWRI magic (it checks the first u32 against GGUF's).

    It also parses through a plain ndarray view of the mapping: slicing `np.memmap` objects costs
    microseconds each, which made a 49k-token vocabulary take seconds to read.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_view

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self.mapping = mapped
        self._plain_view = mapped.view(np.ndarray)

    def _get(self, offset, dtype, count=1, override_order=None):  # type: ignore[override]
        values = super()._get(offset, dtype, count, override_order)
        if offset == 0 and count == 1 and values.dtype == np.uint32 and int(values[0]) == PWRI_MAGIC:
            return np.array([GGUF_MAGIC], dtype=np.uint32)
        return values


def tolerant_reader(path: str | os.PathLike[str]) -> GGUFReader:
    """The `gguf` package's reader for GGUF or PowerInfer GGUF (for tools that need its fields)."""
    return _MagicTolerantReader(path)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its ggml type, its shape in torch order (rows first) and its raw bytes (mapped)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # mapped from the file: float arrays for F32/F16, uint8 blocks otherwise

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements * size // block

    def rows_as_bytes(self) -> np.ndarray:
        """The data as a [rows, bytes_per_row] uint8 array, whatever its type."""
        return self.data.view(np.uint8).reshape(self.shape[0] if len(self.shape) > 1 else 1, -1)


class GGUFFile:
    """A GGUF or PowerInfer GGUF file: metadata as Python values, tensors mapped rather than read."""

    def __init__(self, path: Path, magic: str, metadata: dict[str, Any], tensors: dict[str, GGUFTensor],
                 mapping: np.memmap):
        self.path, self.magic, self.metadata, self.tensors = path, magic, metadata, tensors
        self._mapping = mapping

    @property
    def is_powerinfer(self) -> bool:
        return self.magic == "PWRI"

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing") from None

    def dominant_type_name(self) -> str:
        """The tensor type holding most of the bytes, e.g. "Q4_1" (how models are usually labelled)."""
        totals: dict[str, int] = {}
        for t in self.tensors.values():
            totals[t.ggml_type.name] = totals.get(t.ggml_type.name, 0) + t.n_bytes
        return max(totals, key=totals.get) if totals else "none"

    @property
    def file_size(self) -> int:
        return os.path.getsize(self.path)

    def release_pages(self) -> None:
        """Drop the mapped pages from this process's resident set (the page cache keeps them).

        Called once weights have been repacked: the mapping stays valid and pages fault back on use.
        """
        mapping = getattr(self._mapping, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED)


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Decode every key/value pair.

    The reader holds one numpy object per vocabulary string (~70 MB for a 49k vocabulary). Python
    objects made while those live end up scattered among them, and the heap cannot shrink once they
    are freed; so array values are first packed into a few large buffers, and turned into Python
    lists only after the reader is gone (the caller calls the returned thunks).
    """
    values: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types and field.types[0] == GGUFValueType.ARRAY:
            parts = [field.parts[i] for i in field.data]
            if field.types[-1] == GGUFValueType.STRING:
                lengths = np.array([p.nbytes for p in parts], dtype=np.int64)
                values[name] = ("strings", b"".join(p.tobytes() for p in parts), lengths)
            else:
                values[name] = ("numbers", np.concatenate(parts) if parts else np.array([]), None)
        else:
            values[name] = _plain(field.contents())
    return values


def _unpack(value: Any) -> Any:
    if not isinstance(value, tuple):
        return value
    kind, data, lengths = value
    if kind == "numbers":
        return data.tolist()
    ends = np.cumsum(lengths).tolist()
    return [data[start:end].decode("utf-8", errors="replace") for start, end in zip([0, *ends[:-1]], ends)]


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Map a GGUF or PowerInfer GGUF file; raise `ModelFileError` with one clear line if we can't."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        head = f.read(4)
    magic = MAGICS.get(int.from_bytes(head, "little")) if len(head) == 4 else None
    if magic is None:
        raise ModelFileError(f"{path}: not a GGUF file (magic {head!r})")
    try:
        reader = _MagicTolerantReader(path)
        packed = _read_metadata(reader)
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError) as error:
        raise ModelFileError(f"{path}: corrupt or truncated GGUF ({error})") from None
    size = os.path.getsize(path)
    tensors = {}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelFileError(f"{path}: truncated GGUF (tensor {t.name} runs past the end of the file)")
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
    mapping = reader.mapping
    del reader  # frees the per-field objects before the metadata lists are built
    return GGUFFile(path, magic, {k: _unpack(v) for k, v in packed.items()}, tensors, mapping)
