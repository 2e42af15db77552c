"""Encode float tensors into GGUF tensor types: `gguf.quants` where it can encode the type, our
K-quant encoders (`kquants`) where it cannot."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType, quants

from powerinfer.convert.kquants import K_QUANT_TYPES, quantize_k
from powerinfer.errors import PowerInferError
from powerinfer.gguf.writer import TensorData

T = GGMLQuantizationType
OUTTYPES = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}
# `general.file_type` uses llama.cpp's file-type numbers, which differ from tensor-type numbers.
FILE_TYPES = {
    T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16, T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: LlamaFileType.MOSTLY_Q4_0, T.Q4_1: LlamaFileType.MOSTLY_Q4_1,
}

# llama-quantize's fallback for K-quant rows that do not split into 256-value super-blocks
# (`tensor_type_fallback` in llama.cpp's src/llama-quant.cpp).
K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def storable(ggml_type: T, width: int) -> T:
    """`ggml_type`, or its fallback when rows of `width` values do not split into its blocks."""
    if width % GGML_QUANT_SIZES[ggml_type][0] == 0:
        return ggml_type
    fallback = K_FALLBACK.get(ggml_type, T.F16)
    return fallback if width % GGML_QUANT_SIZES[fallback][0] == 0 else T.F16


def parse_outtype(name: str) -> T:
    try:
        return OUTTYPES[name.lower()]
    except KeyError:
        raise PowerInferError(f"unsupported output type {name!r} (choose from {', '.join(OUTTYPES)})") from None


def encode_tensor(name: str, array: np.ndarray, outtype: T) -> TensorData:
    """Store vectors as F32 and matrices as `outtype`; a matrix whose rows do not split into whole
    blocks of `outtype` falls back (`storable`: K-quants as llama-quantize does, the others
    to F16 as llama.cpp's converter does)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 1 or outtype == T.F32:
        return TensorData(name, array, T.F32)
    outtype = storable(outtype, array.shape[-1])
    if outtype == T.F16:
        return TensorData(name, array.astype(np.float16), T.F16)
    if outtype in K_QUANT_TYPES:
        return TensorData(name, quantize_k(array, outtype), outtype)
    return TensorData(name, quants.quantize(array, outtype), outtype)
