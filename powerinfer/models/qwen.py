"""Qwen2 (biases on Q, K and V) and Qwen3 (an RMSNorm per Q and K head before RoPE): llama blocks
whose RoPE pairs the two halves of each head (GGML's NeoX mode: llama.cpp's converter leaves their
Q and K rows as Hugging Face has them). They decode on llama's native step, with its options."""

from __future__ import annotations

from functools import partial

from powerinfer.config import RMS_NORM_EPS_KEY, ArchitectureDefaults, FFNActivation
from powerinfer.models.architecture import Architecture
from powerinfer.models.llama import LlamaModel
from powerinfer.models.tensors import rms_decoder_tensors


class QwenModel(LlamaModel):
    ROPE_INTERLEAVED = False


DEFAULTS = ArchitectureDefaults(RMS_NORM_EPS_KEY, FFNActivation.SILU_GATED, FFNActivation.RELU_GATED)
ARCHITECTURES = (
    Architecture(("qwen2",), QwenModel, DEFAULTS, rms_decoder_tensors),  # biases: optional tensors of every table
    Architecture(("qwen3",), QwenModel, DEFAULTS, partial(rms_decoder_tensors, head_norms=True)),
)
