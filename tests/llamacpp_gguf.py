"""A small GGUF writer for the tests, following llama.cpp's conventions (convert_hf_to_gguf.py) and
knowing nothing of powerinfer's converter: tensor names from `gguf.TensorNameMap`, metadata through
`gguf.GGUFWriter`'s own methods, and llama.cpp's changes to the weights (Gemma's norms stored as
1 + w, llama's Q and K rows permuted for its RoPE, Mixtral's experts stacked into 3-D tensors).
Float32 throughout: files to check our reading of other tools' files against transformers."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGUFWriter, get_tensor_name_map
from safetensors import safe_open
from transformers import PreTrainedModel

ARCHES = {"qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3, "gemma3_text": MODEL_ARCH.GEMMA3,
          "phi3": MODEL_ARCH.PHI3, "mixtral": MODEL_ARCH.LLAMA}
EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def _llama_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved into adjacent pairs."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _metadata(writer: GGUFWriter, arch: MODEL_ARCH, c) -> None:
    n_head = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_head
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_vocab_size(c.vocab_size)
    for token, add in ((c.bos_token_id, writer.add_bos_token_id), (c.eos_token_id, writer.add_eos_token_id),
                       (c.pad_token_id, writer.add_pad_token_id)):
        if token is not None:  # what llama.cpp's converter takes from the tokenizer's special tokens
            add(token)
    if head_dim != c.hidden_size // n_head or arch == MODEL_ARCH.GEMMA3:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == MODEL_ARCH.GEMMA3:
        writer.add_sliding_window(c.sliding_window)
        if c.final_logit_softcapping:
            writer.add_final_logit_softcapping(c.final_logit_softcapping)
    elif arch == MODEL_ARCH.PHI3:
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // n_head
        writer.add_rope_dimension_count(rope_dims)
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", c.max_position_embeddings))
        writer.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):
            scale = c.max_position_embeddings / rope["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) if scale > 1 else 1.0)
    else:
        writer.add_rope_dimension_count(head_dim)
    if arch == MODEL_ARCH.LLAMA:
        writer.add_expert_count(c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)


def _checkpoint(folder: Path):
    """(name, tensor) of the safetensors files in `folder`: what llama.cpp's converter reads."""
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _tensors(folder: Path, c, arch: MODEL_ARCH) -> dict[str, np.ndarray]:
    names = get_tensor_name_map(arch, c.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name, tensor in _checkpoint(folder):
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        expert = EXPERT.fullmatch(hf_name)
        if expert:  # gathered per layer and kind, stacked below as llama.cpp does
            experts.setdefault((int(expert[1]), expert[3]), {})[int(expert[2])] = data
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch == MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
            data = data + 1  # Gemma3RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w
        if arch == MODEL_ARCH.LLAMA and name.endswith(("attn_q.weight", "attn_k.weight")):
            data = _llama_permute(data, c.num_attention_heads if "attn_q" in name else c.num_key_value_heads)
        out[name] = data
    for (layer, kind), by_expert in experts.items():
        name = names.get_name(f"model.layers.{layer}.block_sparse_moe.experts.{kind}.weight", try_suffixes=(".weight",))
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    rope = c.rope_parameters
    if arch == MODEL_ARCH.PHI3 and rope.get("long_factor"):
        for tensor, key in ((MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"), (MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor")):
            out[TENSOR_NAMES[tensor] + ".weight"] = np.asarray(rope[key], dtype=np.float32)
    return out


def write_llamacpp_gguf(model: PreTrainedModel, folder: Path, path: Path) -> Path:
    """`model`, saved in `folder` by save_pretrained, as llama.cpp's converter would write it, in float32."""
    arch = ARCHES[model.config.model_type]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, MODEL_ARCH_NAMES[arch])
    _metadata(writer, arch, model.config)
    for name, data in _tensors(folder, model.config, arch).items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_reading(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """transformers' own reading of a GGUF file (config and weights from the file alone)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
