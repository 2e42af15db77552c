"""A model file's label as llama.cpp prints it ("Q4_K - Medium"), from `general.file_type`."""

from __future__ import annotations

from gguf import LlamaFileType

from powerinfer.gguf.reader import GGUFFile

# llama.cpp's `llama_model_ftype_name` spells the K-quant mixes' sizes out; the other types go by
# their tensor type's name.
MIX_SIZES = {"S": "Small", "M": "Medium", "L": "Large"}
SPECIAL = {LlamaFileType.ALL_F32: "all F32", LlamaFileType.MOSTLY_Q2_K: "Q2_K - Medium"}


def file_type_label(gguf: GGUFFile) -> str:
    """The label of the file's `general.file_type`; without one (or an unknown number), the tensor
    type holding the most bytes, as llama.cpp guesses it."""
    code = gguf.get("general.file_type")
    try:
        file_type = LlamaFileType(code & ~1024)  # 1024: llama.cpp's "guessed" flag
    except (TypeError, ValueError):
        return gguf.dominant_type_name()
    if file_type in SPECIAL:
        return SPECIAL[file_type]
    name = file_type.name.removeprefix("MOSTLY_")
    base, _, size = name.rpartition("_")
    if base.endswith("K") and size in MIX_SIZES:
        return f"{base} - {MIX_SIZES[size]}"
    return name
