"""powerinfer: LLM inference for machines whose accelerator is too small for the model.

The public API is `LLM` and `SamplingParams`; they are imported on first use so that the command
line starts without loading torch.
"""

from typing import TYPE_CHECKING

from powerinfer.errors import PowerInferError

if TYPE_CHECKING:
    from powerinfer.llm import LLM
    from powerinfer.runtime.sampling import SamplingParams

__all__ = ["LLM", "PowerInferError", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from powerinfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from powerinfer.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'powerinfer' has no attribute {name!r}")
