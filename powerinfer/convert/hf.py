"""Hugging Face checkpoint folder (config.json, safetensors, tokenizer files) -> GGUF.

Tensor names follow llama.cpp through `gguf.TensorNameMap`; Q and K rows are permuted the way
llama.cpp's converter does, so our files and llama.cpp's are interchangeable.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, get_tensor_name_map

from powerinfer.config import ACTIVATION_KEY, HF_GATED_ACTIVATIONS
from powerinfer.convert.model import ModelSource, write_model
from powerinfer.convert.tokenizer import tokenizer_metadata
from powerinfer.errors import ModelFileError, UnsupportedModelError


@dataclass
class HFCheckpoint:
    folder: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path) -> "HFCheckpoint":
        folder = Path(folder)
        config_path = folder / "config.json"
        if not config_path.exists():
            raise ModelFileError(f"{folder}: not a Hugging Face checkpoint (no config.json)")
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as error:
            raise ModelFileError(f"{config_path}: invalid JSON ({error.msg})") from None
        return cls(folder, config)

    @property
    def architecture_class(self) -> str:
        return (self.config.get("architectures") or ["?"])[0]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, float32 tensor) for every weight in the checkpoint."""
        from safetensors import safe_open

        files = sorted(self.folder.glob("*.safetensors"))
        if files:
            for file in files:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name).float()
            return
        bins = sorted(self.folder.glob("pytorch_model*.bin"))
        if not bins:
            raise ModelFileError(f"{self.folder}: no *.safetensors or pytorch_model*.bin weights")
        for file in bins:
            for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
                yield name, tensor.float()


def _permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's half-split rotary layout -> GGML's adjacent-pair layout, per head."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_metadata(ckpt: HFCheckpoint) -> tuple[str, dict[str, Any]]:
    c = ckpt.config
    activation = HF_GATED_ACTIVATIONS.get(c.get("hidden_act", "silu"))
    if activation is None:
        raise UnsupportedModelError(f"{ckpt.folder}: unsupported hidden_act {c.get('hidden_act')!r}")
    n_head = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
    arch = "llama"
    meta: dict[str, Any] = {
        f"{arch}.context_length": int(c.get("max_position_embeddings", 2048)),
        f"{arch}.embedding_length": int(c["hidden_size"]),
        f"{arch}.block_count": int(c["num_hidden_layers"]),
        f"{arch}.feed_forward_length": int(c["intermediate_size"]),
        f"{arch}.attention.head_count": int(n_head),
        f"{arch}.attention.head_count_kv": int(c.get("num_key_value_heads") or n_head),
        f"{arch}.rope.freq_base": float(c.get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        f"{arch}.rope.dimension_count": int(head_dim),
        f"{arch}.vocab_size": int(c["vocab_size"]),
        ACTIVATION_KEY: activation.value,
    }
    if head_dim != c["hidden_size"] // n_head:
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = int(head_dim)
    scaling = c.get("rope_scaling") or {}
    if scaling.get("type", scaling.get("rope_type")) == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
    elif scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise UnsupportedModelError(f"{ckpt.folder}: unsupported rope_scaling {scaling}")
    return arch, meta


def llama_tensors(ckpt: HFCheckpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight, Q and K permuted as llama.cpp does."""
    c = ckpt.config
    n_head = c["num_attention_heads"]
    n_head_kv = c.get("num_key_value_heads") or n_head
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, c["num_hidden_layers"])
    tied = c.get("tie_word_embeddings", False)
    for hf_name, tensor in ckpt.tensors():
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise UnsupportedModelError(f"{ckpt.folder}: cannot map tensor {hf_name!r}")
        if name.endswith("attn_q.weight"):
            tensor = _permute_qk(tensor, n_head)
        elif name.endswith("attn_k.weight"):
            tensor = _permute_qk(tensor, n_head_kv)
        yield name, tensor.numpy()


# Hugging Face architecture class -> (metadata, tensors) readers.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": (llama_metadata, llama_tensors),
    "MistralForCausalLM": (llama_metadata, llama_tensors),
}


def hf_source(folder: str | Path) -> ModelSource:
    """A Hugging Face checkpoint folder as a conversion source."""
    ckpt = HFCheckpoint.open(folder)
    readers = HF_ARCHITECTURES.get(ckpt.architecture_class)
    if readers is None:
        raise UnsupportedModelError(f"{ckpt.folder}: unsupported architecture {ckpt.architecture_class} "
                                    f"(supported: {', '.join(HF_ARCHITECTURES)})")
    read_metadata, read_tensors = readers
    arch, meta = read_metadata(ckpt)
    meta["general.name"] = ckpt.folder.name
    meta.update(tokenizer_metadata(ckpt.folder, n_vocab=int(ckpt.config["vocab_size"])))
    return ModelSource(ckpt.folder, arch, meta, {}, read_tensors(ckpt),
                       *(int(meta[f"{arch}.{k}"]) for k in ("block_count", "embedding_length", "feed_forward_length")))


def convert_hf(folder: str | Path, outfile: str | Path, outtype: GGMLQuantizationType, progress: bool = True) -> None:
    """Convert a Hugging Face checkpoint folder to a GGUF file."""
    write_model(hf_source(folder), outfile, outtype, progress=progress)
