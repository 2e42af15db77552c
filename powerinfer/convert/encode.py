"""Encode float tensors into GGUF tensor types (through `gguf.quants`)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType, quants

from powerinfer.errors import PowerInferError
from powerinfer.gguf.writer import TensorData

T = GGMLQuantizationType
OUTTYPES = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1}
QUANTIZE_TYPES = ("q4_0", "q4_1", "q8_0")
# `general.file_type` uses llama.cpp's file-type numbers, which differ from tensor-type numbers.
FILE_TYPES = {
    T.F32: LlamaFileType.ALL_F32, T.F16: LlamaFileType.MOSTLY_F16, T.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    T.Q4_0: LlamaFileType.MOSTLY_Q4_0, T.Q4_1: LlamaFileType.MOSTLY_Q4_1,
}


def parse_outtype(name: str) -> T:
    try:
        return OUTTYPES[name.lower()]
    except KeyError:
        raise PowerInferError(f"unsupported output type {name!r} (choose from {', '.join(OUTTYPES)})") from None


def encode_tensor(name: str, array: np.ndarray, outtype: T) -> TensorData:
    """Store vectors and a mixture of experts' router (ffn_gate_inp: llama.cpp never quantizes it, a
    rounded router picks other experts) as F32 and matrices as `outtype`; a matrix whose rows do not
    split into whole quantization blocks falls back to F16 (as llama.cpp's converter does)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 1 or outtype == T.F32 or name.endswith("ffn_gate_inp.weight"):
        return TensorData(name, array, T.F32)
    if outtype == T.F16:
        return TensorData(name, array.astype(np.float16), T.F16)
    block = 32
    if array.shape[-1] % block:
        return TensorData(name, array.astype(np.float16), T.F16)
    return TensorData(name, quants.quantize(array, outtype), outtype)
