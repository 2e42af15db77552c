"""Open GGUF and PowerInfer GGUF (magic `PWRI`) files: a bounded header parser, tensors mapped.

Why our own parser rather than `gguf.GGUFReader`: that reader trusts the counts and lengths in a
header (a 49-byte file declaring an array of 2**40 strings makes it read past the end and allocate
until memory runs out), and accepting PowerInfer's magic meant overriding its private members. The
format is small: magic, version, tensor and key/value counts, the key/value pairs, the tensor
infos, then tensor data at an aligned offset. So this module parses it itself, checking every count
and length against the bytes left in the file before anything is allocated or looped over, and
keeps using the `gguf` package for what it defines: value types, tensor types and their sizes.
Every way a file can be broken becomes one `ModelFileError` line.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC

from powerinfer.errors import ModelFileError

# PowerInfer GGUF files are GGUF with another magic: the bytes "PWRI" read as a little-endian u32.
PWRI_MAGIC = int.from_bytes(b"PWRI", "little")
MAGICS = {GGUF_MAGIC: "GGUF", PWRI_MAGIC: "PWRI"}
SUPPORTED_VERSIONS = (2, 3)  # v1 had 32-bit counts; nothing we read was written with it
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # arrays of arrays are legal; a deeper nesting is an attack on the stack

# struct formats of GGUF's fixed-size value types (little-endian); numpy dtypes are derived from them.
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_SCALARS = {vtype: struct.Struct("<" + fmt) for vtype, fmt in SCALAR_FORMATS.items()}
_U64 = _SCALARS[GGUFValueType.UINT64]
# The fewest bytes a value of each type can take (a string: its u64 length; an array: type + count).
_MIN_VALUE_BYTES = {**{vtype: s.size for vtype, s in _SCALARS.items()}, GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

# Tensor types whose data is an array of plain numbers; other types are viewed as uint8 blocks.
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}

ValueTypes = tuple[GGUFValueType, GGUFValueType | None]  # (type, item type for arrays)


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: its ggml type, its shape in torch order (rows first) and its raw bytes (mapped)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # mapped from the file: number arrays for F32/F16/I32..., uint8 blocks otherwise

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

    def rows(self, start: int, end: int) -> GGUFTensor:
        """Rows start..end of a matrix, as a tensor of its own (a view of the same bytes)."""
        return GGUFTensor(f"{self.name}[{start}:{end}]", self.ggml_type, (end - start, *self.shape[1:]), self.data[start:end])


class GGUFFile:
    """A GGUF or PowerInfer GGUF file: metadata as Python values, tensors mapped rather than read."""

    def __init__(self, path: Path, magic: str, metadata: dict[str, Any], tensors: dict[str, GGUFTensor],
                 mapping: mmap.mmap, value_types: dict[str, ValueTypes] | None = None):
        self.path, self.magic, self.metadata, self.tensors = path, magic, metadata, tensors
        self.value_types = value_types or {}  # each key's GGUF type, to copy metadata exactly
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

    def drop_metadata(self, prefix: str) -> None:
        """Forget the metadata keys starting with `prefix` (a vocabulary once a tokenizer holds it:
        tens of MB of Python strings that would otherwise stay resident while the weights load)."""
        for key in [key for key in self.metadata if key.startswith(prefix)]:
            del self.metadata[key]
            self.value_types.pop(key, None)

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
        return len(self._mapping)

    def release_pages(self) -> None:
        """Drop the mapped pages from this process's resident set (the page cache keeps them).

        Called once weights have been repacked: the mapping stays valid and pages fault back on use.
        """
        if hasattr(self._mapping, "madvise"):
            self._mapping.madvise(mmap.MADV_DONTNEED)


class _Cursor:
    """Reads a mapped file front to back; no read, count or length may pass the end of the file."""

    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.pos, self.end = data, path, 0, len(data)

    def fail(self, message: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: corrupt or truncated GGUF ({message} at byte {self.pos})")

    def need(self, n_bytes: int, what: str) -> None:
        if n_bytes > self.end - self.pos:
            raise self.fail(f"{what} needs {n_bytes} bytes, {self.end - self.pos} are left")

    def scalar(self, vtype: GGUFValueType) -> Any:
        packer = _SCALARS[vtype]
        self.need(packer.size, vtype.name)
        (value,) = packer.unpack_from(self.data, self.pos)
        self.pos += packer.size
        return value

    def count(self, min_item_bytes: int, what: str) -> int:
        """A u64 count of items that each take at least `min_item_bytes`, checked against the rest."""
        n = self.scalar(GGUFValueType.UINT64)
        if n * min_item_bytes > self.end - self.pos:
            raise self.fail(f"{n} {what} cannot fit in the {self.end - self.pos} bytes left")
        return n

    def string(self) -> str:
        n = self.count(1, "string bytes")
        text = self.data[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value_type(self) -> GGUFValueType:
        code = self.scalar(GGUFValueType.UINT32)
        try:
            return GGUFValueType(code)
        except ValueError:
            raise self.fail(f"unknown value type {code}") from None

    def value(self, vtype: GGUFValueType, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array(self.value_type(), depth + 1)
        return self.scalar(vtype)

    def array(self, item_type: GGUFValueType, depth: int = 0) -> list[Any]:
        """An array's items (its item type already read)."""
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"arrays nested deeper than {MAX_ARRAY_NESTING}")
        n = self.count(_MIN_VALUE_BYTES[item_type], f"{item_type.name} array items")
        if item_type in _SCALARS:  # one bulk read: vocabularies hold ~10^5 numbers
            dtype = np.dtype("<" + SCALAR_FORMATS[item_type])
            items = np.frombuffer(self.data, dtype, n, self.pos).tolist()
            self.pos += n * dtype.itemsize
            return items
        if item_type == GGUFValueType.STRING:
            return self.strings(n)
        return [self.array(self.value_type(), depth + 1) for _ in range(n)]

    def strings(self, n: int) -> list[str]:
        """`n` strings, in one tight loop (a vocabulary and its merges are ~10^5 of them)."""
        data, pos, end, unpack, texts = self.data, self.pos, self.end, _U64.unpack_from, []
        for _ in range(n):
            if pos + 8 > end:
                break
            (length,) = unpack(data, pos)
            if length > end - pos - 8:
                break
            texts.append(data[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        self.pos = pos
        if len(texts) < n:
            raise self.fail(f"string {len(texts)} of {n} runs past the end of the file")
        return texts


def _tensor_info(cursor: _Cursor, type_codes: Mapping[int, GGMLQuantizationType]) -> tuple[
        str, list[int], GGMLQuantizationType, int, int]:
    """(name, dims in GGUF order (contiguous first), type, data offset, bytes per row) of the next tensor."""
    name = cursor.string()
    n_dims = cursor.scalar(GGUFValueType.UINT32)
    if not 1 <= n_dims <= MAX_DIMS:
        raise cursor.fail(f"tensor {name!r} has {n_dims} dimensions")
    cursor.need(8 * n_dims, "dimensions")
    dims = [cursor.scalar(GGUFValueType.UINT64) for _ in range(n_dims)]
    # as llama.cpp, element counts are int64 (a 0 beside a huge dimension would still break numpy's shape)
    if math.prod(max(d, 1) for d in dims) >= 1 << 63:
        raise cursor.fail(f"tensor {name!r} has dimensions {dims}: more elements than a 64-bit count holds")
    code = cursor.scalar(GGUFValueType.UINT32)
    ggml_type = type_codes.get(code)
    if ggml_type is None:
        try:
            ggml_type = GGMLQuantizationType(code)
        except ValueError:
            raise cursor.fail(f"tensor {name!r} has unknown type code {code}") from None
    if ggml_type not in GGML_QUANT_SIZES:
        raise cursor.fail(f"tensor {name!r} has type {ggml_type.name}, whose size is unknown")
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    if dims[0] % block:  # (a dimension may be 0: a GPU index stores an empty layer's bucket so)
        raise cursor.fail(f"tensor {name!r}: rows of {dims[0]} are not whole {ggml_type.name} blocks of {block}")
    return name, dims, ggml_type, cursor.scalar(GGUFValueType.UINT64), dims[0] // block * type_size


def _parse(cursor: _Cursor, type_codes: Mapping[int, GGMLQuantizationType]) -> tuple[
        str, dict[str, Any], dict[str, ValueTypes], dict[str, GGUFTensor]]:
    magic = MAGICS[cursor.scalar(GGUFValueType.UINT32)]
    version = cursor.scalar(GGUFValueType.UINT32)
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{cursor.path}: unsupported GGUF version {version} (supported: 2, 3, little-endian)")
    n_tensors = cursor.scalar(GGUFValueType.UINT64)
    n_kv = cursor.count(_MIN_KV_BYTES, "metadata entries")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > cursor.end - cursor.pos:
        raise cursor.fail(f"{n_tensors} tensor infos cannot fit in the {cursor.end - cursor.pos} bytes left")

    metadata: dict[str, Any] = {}
    types: dict[str, ValueTypes] = {}
    for _ in range(n_kv):
        key = cursor.string()
        if key in metadata:
            raise cursor.fail(f"duplicate metadata key {key!r}")
        vtype = cursor.value_type()
        if vtype == GGUFValueType.ARRAY:
            item_type = cursor.value_type()
            metadata[key], types[key] = cursor.array(item_type), (vtype, item_type)
        else:
            metadata[key], types[key] = cursor.value(vtype), (vtype, None)
    infos = [_tensor_info(cursor, type_codes) for _ in range(n_tensors)]

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise ModelFileError(f"{cursor.path}: corrupt GGUF (general.alignment {alignment!r} is not a power of two)")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, ggml_type, offset, row_bytes in infos:
        if name in tensors:
            raise ModelFileError(f"{cursor.path}: corrupt GGUF (two tensors named {name!r})")
        if offset % alignment:
            raise ModelFileError(f"{cursor.path}: corrupt GGUF (tensor {name!r} at offset {offset}, "
                                 f"not a multiple of the alignment {alignment})")
        start, n_bytes = data_start + offset, row_bytes * math.prod(dims[1:])  # Python ints: no overflow
        if start + n_bytes > cursor.end:
            raise ModelFileError(f"{cursor.path}: truncated GGUF (tensor {name} runs past the end of the file)")
        raw = np.frombuffer(cursor.data, np.uint8, n_bytes, start)
        shape = tuple(reversed(dims))
        plain = _PLAIN_TENSOR_DTYPES.get(ggml_type)
        data = raw.view(plain).reshape(shape) if plain else raw.reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, ggml_type, shape, data)
    return magic, metadata, types, tensors


def _map_regular_file(path: Path) -> mmap.mmap:
    """Map `path` read-only. It must be a regular file: opened without blocking (a FIFO would wait
    for a writer forever) and checked on the open descriptor, so nothing can swap it in between."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path}: is a directory, not a GGUF file") from None
    except OSError as error:
        raise ModelFileError(f"{path}: cannot open ({error.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ModelFileError(f"{path}: is a directory, not a GGUF file")
        if not stat.S_ISREG(mode):
            raise ModelFileError(f"{path}: not a regular file")
        head = os.pread(fd, 4, 0)
        magic = int.from_bytes(head, "little") if len(head) == 4 else None
        if magic not in MAGICS:
            raise ModelFileError(f"{path}: not a GGUF file (magic {head!r})")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise ModelFileError(f"{path}: cannot read ({error.strerror})") from None
    finally:
        os.close(fd)


def open_gguf(path: str | os.PathLike[str], type_codes: Mapping[int, GGMLQuantizationType] | None = None) -> GGUFFile:
    """Map a GGUF or PowerInfer GGUF file; raise `ModelFileError` with one clear line if we can't.

    `type_codes`: tensor type codes that mean another type in this file's numbering than in the
    `gguf` package's (PowerInfer's GPU index stores I32 as 18)."""
    path = Path(path)
    mapping = _map_regular_file(path)
    magic, metadata, types, tensors = _parse(_Cursor(mapping, path), type_codes or {})
    return GGUFFile(path, magic, metadata, tensors, mapping, types)
