"""Hugging Face checkpoint folder (config.json, safetensors, tokenizer files) -> GGUF.

Tensor names follow llama.cpp through `gguf.TensorNameMap` (OPT: PowerInfer's llama.cpp fork);
llama's Q and K rows are permuted, and Falcon's fused QKV rows reordered, the way llama.cpp's
converter does, so our files and llama.cpp's are interchangeable.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, TensorNameMap, get_tensor_name_map

from powerinfer.config import ACTIVATION_KEY, HF_GATED_ACTIVATIONS, FFNActivation
from powerinfer.convert.model import ModelSource, write_model
from powerinfer.convert.tokenizer import tokenizer_metadata
from powerinfer.errors import ModelFileError, UnsupportedModelError
from powerinfer.models.gemma import llama_cpp_query_scale
from powerinfer.sparse.folders import load_torch_file


@dataclass
class HFCheckpoint:
    folder: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path) -> HFCheckpoint:
        folder = Path(folder)
        config_path = folder / "config.json"
        if not config_path.exists():
            raise ModelFileError(f"{folder}: not a Hugging Face checkpoint (no config.json)")
        try:
            config = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ModelFileError(f"{config_path}: invalid JSON ({getattr(error, 'msg', error)})") from None
        if not isinstance(config, dict):
            raise ModelFileError(f"{config_path}: not a JSON object")
        return cls(folder, config)

    @property
    def architecture_class(self) -> str:
        return (self.config.get("architectures") or ["?"])[0]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, float32 tensor) for every weight in the checkpoint."""
        from safetensors import SafetensorError, safe_open

        files = sorted(self.folder.glob("*.safetensors"))
        if files:
            for file in files:
                try:
                    with safe_open(file, framework="pt") as f:
                        names = list(f.keys())
                        for name in names:
                            yield name, f.get_tensor(name).float()
                except SafetensorError as error:
                    raise ModelFileError(f"{file}: not a readable safetensors file ({error})") from None
            return
        bins = sorted(self.folder.glob("pytorch_model*.bin"))
        if not bins:
            raise ModelFileError(f"{self.folder}: no *.safetensors or pytorch_model*.bin weights")
        for file in bins:
            state = load_torch_file(file)
            if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise ModelFileError(f"{file}: not a state dict of tensors")
            for name, tensor in state.items():
                yield name, tensor.float()


def _permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's half-split rotary layout -> GGML's adjacent-pair layout, per head."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _rope_metadata(ckpt: HFCheckpoint, arch: str, layer_type: str | None = None) -> dict[str, Any]:
    """RoPE base and linear scaling, from `rope_parameters` (transformers >= 5; per layer type for
    Gemma 3, whose `layer_type` "full_attention" is the one llama.cpp's keys describe) or
    `rope_theta` and `rope_scaling` (older configs)."""
    c = ckpt.config
    params = c.get("rope_parameters") or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    meta: dict[str, Any] = {f"{arch}.rope.freq_base": float(params.get("rope_theta", c.get("rope_theta", 10000.0)))}
    scaling = c.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(scaling["factor"])
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"{ckpt.folder}: unsupported rope_scaling {scaling}")
    return meta


def _reject(ckpt: HFCheckpoint, variants: dict[str, bool]) -> None:
    """Raise for the first unsupported variant (description -> whether the checkpoint is one)."""
    for what, found in variants.items():
        if found:
            raise UnsupportedModelError(f"{ckpt.folder}: {ckpt.architecture_class} with {what} is not supported")


def _gguf_name(ckpt: HFCheckpoint, names: TensorNameMap, hf_name: str) -> str:
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UnsupportedModelError(f"{ckpt.folder}: cannot map tensor {hf_name!r}")
    return name


def llama_metadata(ckpt: HFCheckpoint, arch: str = "llama") -> tuple[str, dict[str, Any]]:
    """Metadata of a llama-shaped checkpoint (llama, Mistral, Qwen2, Qwen3), as GGUF architecture `arch`."""
    c = ckpt.config
    _reject(ckpt, {"sliding-window attention (use_sliding_window=true)": c.get("use_sliding_window", False)})
    return arch, {**_decoder_metadata(ckpt, arch, c.get("hidden_act", "silu")), **_rope_metadata(ckpt, arch)}


def _decoder_metadata(ckpt: HFCheckpoint, arch: str, hidden_act: str) -> dict[str, Any]:
    """Shapes, eps and FFN activation of a decoder with RMSNorms and a gated FFN."""
    c = ckpt.config
    activation = HF_GATED_ACTIVATIONS.get(hidden_act)
    if activation is None:
        raise UnsupportedModelError(f"{ckpt.folder}: unsupported hidden activation {hidden_act!r}")
    n_head = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
    meta: dict[str, Any] = {
        f"{arch}.context_length": int(c.get("max_position_embeddings", 2048)),
        f"{arch}.embedding_length": int(c["hidden_size"]),
        f"{arch}.block_count": int(c["num_hidden_layers"]),
        f"{arch}.feed_forward_length": int(c["intermediate_size"]),
        f"{arch}.attention.head_count": int(n_head),
        f"{arch}.attention.head_count_kv": int(c.get("num_key_value_heads") or n_head),
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        f"{arch}.rope.dimension_count": int(head_dim),
        f"{arch}.vocab_size": int(c["vocab_size"]),
        ACTIVATION_KEY: activation.value,
    }
    if head_dim != c["hidden_size"] // n_head:
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = int(head_dim)
    return meta


def llama_tensors(ckpt: HFCheckpoint, arch: MODEL_ARCH = MODEL_ARCH.LLAMA,
                  source: Iterator[tuple[str, torch.Tensor]] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight (of `source`, default the checkpoint's); llama's Q
    and K rows permuted as llama.cpp does (its RoPE pairs adjacent values; Qwen's, as NeoX, pairs
    halves and keeps Hugging Face's rows)."""
    c = ckpt.config
    n_head = c["num_attention_heads"]
    n_head_kv = c.get("num_key_value_heads") or n_head
    names = get_tensor_name_map(arch, c["num_hidden_layers"])
    permute = arch == MODEL_ARCH.LLAMA
    for name, tensor in _mapped_tensors(ckpt, names, tied_default=False, source=source):
        if permute and name.endswith("attn_q.weight"):
            tensor = _permute_qk(tensor, n_head)
        elif permute and name.endswith("attn_k.weight"):
            tensor = _permute_qk(tensor, n_head_kv)
        yield name, tensor.numpy()


def _mapped_tensors(ckpt: HFCheckpoint, names: TensorNameMap, tied_default: bool,
                    source: Iterator[tuple[str, torch.Tensor]] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) for every weight (of `source`, default the checkpoint's) but rotary caches
    and a tied lm_head."""
    tied = ckpt.config.get("tie_word_embeddings", tied_default)
    for hf_name, tensor in ckpt.tensors() if source is None else source:
        if hf_name.endswith("rotary_emb.inv_freq") or (tied and hf_name == "lm_head.weight"):
            continue
        yield _gguf_name(ckpt, names, hf_name), tensor


def gemma3_metadata(ckpt: HFCheckpoint) -> tuple[str, dict[str, Any]]:
    """Gemma 3 as llama.cpp writes it, plus what llama.cpp leaves to assumption (it reads none of
    it): which layers use the sliding window, their RoPE base, and the query scale where it is not
    the one llama.cpp assumes; the logits' soft cap where the config has one."""
    c, arch = ckpt.config, "gemma3"
    # transformers' Gemma 3 ignores it and llama.cpp's converter refuses it
    _reject(ckpt, {"attention soft-capping (attn_logit_softcapping)": c.get("attn_logit_softcapping")})
    meta = {**_decoder_metadata(ckpt, arch, c.get("hidden_activation", "gelu_pytorch_tanh")),
            **_rope_metadata(ckpt, arch, "full_attention")}
    n_head, n_layers = c["num_attention_heads"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or 256  # Gemma3TextConfig's default
    meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = int(head_dim)
    meta[f"{arch}.rope.dimension_count"] = int(head_dim)
    local = (c.get("rope_parameters") or {}).get("sliding_attention") or {}
    meta[f"{arch}.rope.freq_base_swa"] = float(local.get("rope_theta", c.get("rope_local_base_freq", 10000.0)))
    period = c.get("sliding_window_pattern", 6)
    types = c.get("layer_types") or ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                     for i in range(n_layers)]
    if "sliding_attention" in types and c.get("sliding_window"):
        meta[f"{arch}.attention.sliding_window"] = int(c["sliding_window"])
        meta[f"{arch}.attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
    scale = float(c.get("query_pre_attn_scalar", 256)) ** -0.5
    if scale != llama_cpp_query_scale(n_layers, c["hidden_size"], n_head, head_dim):
        meta[f"{arch}.attention.scale"] = scale
    if c.get("final_logit_softcapping"):
        meta[f"{arch}.final_logit_softcapping"] = float(c["final_logit_softcapping"])
    return arch, meta


def gemma3_tensors(ckpt: HFCheckpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight, norms stored as 1 + w as llama.cpp does (Gemma's
    RMSNorm multiplies by 1 + w)."""
    names = get_tensor_name_map(MODEL_ARCH.GEMMA3, ckpt.config["num_hidden_layers"])
    for name, tensor in _mapped_tensors(ckpt, names, tied_default=True):
        yield name, (tensor + 1 if name.endswith("norm.weight") else tensor).numpy()


def phi3_metadata(ckpt: HFCheckpoint) -> tuple[str, dict[str, Any]]:
    """Phi-3 as llama.cpp writes it: partial rotary dimensions, the trained context, LongRoPE's
    magnitude (its frequency factors are tensors: `phi3_tensors`), and the sliding window."""
    c, arch = ckpt.config, "phi3"
    meta = _decoder_metadata(ckpt, arch, c.get("hidden_act", "silu"))
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or rope
    hidden, n_head = c["hidden_size"], c["num_attention_heads"]
    max_positions = int(c.get("max_position_embeddings", 4096))
    trained = int(c.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                  or max_positions)
    meta.update({
        f"{arch}.rope.dimension_count": int(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) * hidden)
                                        // n_head,
        f"{arch}.rope.freq_base": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        f"{arch}.rope.scaling.original_context_length": trained,
    })
    if c.get("sliding_window"):
        meta[f"{arch}.attention.sliding_window"] = int(c["sliding_window"])
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("longrope", "su"):  # transformers' attention factor: stated, else from the context ratio
        factor = scaling.get("factor") or max_positions / trained
        default = math.sqrt(1 + math.log(factor) / math.log(trained)) if factor > 1 else 1.0
        meta[f"{arch}.rope.scaling.attn_factor"] = float(scaling.get("attention_factor") or default)
    elif kind not in (None, "default"):
        raise UnsupportedModelError(f"{ckpt.folder}: unsupported rope_scaling {scaling} (supported: longrope)")
    return arch, meta


def phi3_tensors(ckpt: HFCheckpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight, and LongRoPE's long and short factors as tensors."""
    c = ckpt.config
    names = get_tensor_name_map(MODEL_ARCH.PHI3, c["num_hidden_layers"])
    for name, tensor in _mapped_tensors(ckpt, names, tied_default=False):
        yield name, tensor.numpy()
    scaling = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if scaling.get("long_factor"):
        for kind in ("long", "short"):
            yield f"rope_factors_{kind}.weight", np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)


def mixtral_metadata(ckpt: HFCheckpoint) -> tuple[str, dict[str, Any]]:
    """Mixtral as llama.cpp writes it: a llama with `expert_count` experts per layer, of which each
    token uses `expert_used_count`."""
    c = ckpt.config
    arch, meta = llama_metadata(ckpt)
    meta[f"{arch}.expert_count"] = int(c["num_local_experts"])
    meta[f"{arch}.expert_used_count"] = int(c["num_experts_per_tok"])
    return arch, meta


_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


def mixtral_tensors(ckpt: HFCheckpoint) -> Iterator[tuple[str, np.ndarray]]:
    """llama's tensors, each layer's experts stacked as llama.cpp stores them: w1 (gate), w3 (up) and w2
    (down) of every expert into ffn_gate_exps, ffn_up_exps and ffn_down_exps [n_expert, rows, cols]."""
    n_expert = ckpt.config["num_local_experts"]

    def stacked() -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # a layer's experts of one kind, until all came
        for hf_name, tensor in ckpt.tensors():
            found = _EXPERT.fullmatch(hf_name)
            if found is None:
                yield hf_name, tensor
                continue
            layer, expert, kind = found.groups()
            parts = pending.setdefault((layer, kind), {})
            parts[int(expert)] = tensor
            if len(parts) == n_expert:
                del pending[(layer, kind)]
                stack = torch.stack([parts[e] for e in range(n_expert)])
                yield f"model.layers.{layer}.block_sparse_moe.experts.{kind}.weight", stack
        if pending:
            raise ModelFileError(f"{ckpt.folder}: experts missing in layer {', '.join(sorted({k[0] for k in pending}))}")

    yield from llama_tensors(ckpt, source=stacked())


# Falcon's `activation` -> ours. llama.cpp computes GELU with the tanh approximation; so do we.
FALCON_ACTIVATIONS = {"relu": FFNActivation.RELU, "gelu": FFNActivation.GELU, "gelu_new": FFNActivation.GELU,
                      "gelu_pytorch_tanh": FFNActivation.GELU}


def _falcon_heads(c: dict[str, Any]) -> tuple[int, int]:
    """(query heads, KV heads) as transformers reads a Falcon config: the 7B layout has one KV head
    (multi_query) or one per query head; the new decoder architecture has num_kv_heads."""
    n_head = c["num_attention_heads"]
    if c.get("new_decoder_architecture", False):
        return n_head, c.get("num_kv_heads") or n_head
    return n_head, 1 if c.get("multi_query", True) else n_head


def _falcon_qkv(weight: torch.Tensor, n_head: int, n_head_kv: int) -> torch.Tensor:
    """Falcon's fused QKV rows come per KV group as [its query heads, key, value]; llama.cpp (and
    our Attention) wants all query heads, then all key heads, then all value heads."""
    groups = weight.reshape(n_head_kv, n_head // n_head_kv + 2, -1, weight.shape[-1])
    q, k, v = groups[:, :-2], groups[:, -2], groups[:, -1]
    return torch.cat([part.reshape(-1, weight.shape[-1]) for part in (q, k, v)])


def falcon_metadata(ckpt: HFCheckpoint) -> tuple[str, dict[str, Any]]:
    c = ckpt.config
    _reject(ckpt, {
        "ALiBi positions (alibi=true)": c.get("alibi", False),
        "sequential attention and FFN (parallel_attn=false)": not c.get("parallel_attn", True),
        "linear-layer biases (bias=true)": c.get("bias", False),
        f"activation {c.get('activation')!r}": c.get("activation", "gelu") not in FALCON_ACTIVATIONS,
    })
    n_head, n_head_kv = _falcon_heads(c)
    arch = "falcon"
    return arch, {
        f"{arch}.context_length": int(c.get("max_position_embeddings", 2048)),
        f"{arch}.embedding_length": int(c["hidden_size"]),
        f"{arch}.block_count": int(c["num_hidden_layers"]),
        f"{arch}.feed_forward_length": int(c.get("ffn_hidden_size") or 4 * c["hidden_size"]),
        f"{arch}.attention.head_count": int(n_head),
        f"{arch}.attention.head_count_kv": int(n_head_kv),
        f"{arch}.attention.layer_norm_epsilon": float(c.get("layer_norm_epsilon", 1e-5)),
        f"{arch}.tensor_data_layout": "jploski",  # llama.cpp's name for the reordered QKV rows
        f"{arch}.vocab_size": int(c["vocab_size"]),
        ACTIVATION_KEY: FALCON_ACTIVATIONS[c.get("activation", "gelu")].value,
        **_rope_metadata(ckpt, arch),
    }


def falcon_tensors(ckpt: HFCheckpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight, the QKV rows reordered as llama.cpp does."""
    c = ckpt.config
    n_head, n_head_kv = _falcon_heads(c)
    names = get_tensor_name_map(MODEL_ARCH.FALCON, c["num_hidden_layers"])
    for name, tensor in _mapped_tensors(ckpt, names, tied_default=True):
        if name.endswith("attn_qkv.weight"):
            tensor = _falcon_qkv(tensor, n_head, n_head_kv)
        yield name, tensor.numpy()


# OPT's tensor names (with or without the "model." prefix) -> PowerInfer's (the gguf package has no OPT)
OPT_TENSORS = {"decoder.embed_tokens": "token_embd", "decoder.embed_positions": "position_embd",
               "decoder.final_layer_norm": "output_norm", "lm_head": "output"}
OPT_BLOCK_TENSORS = {"self_attn_layer_norm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                     "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output", "final_layer_norm": "ffn_norm",
                     "fc1": "ffn_up", "fc2": "ffn_down"}
_OPT_BLOCK = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def opt_metadata(ckpt: HFCheckpoint) -> tuple[str, dict[str, Any]]:
    c = ckpt.config
    hidden = c["hidden_size"]
    _reject(ckpt, {
        "post-norm blocks (do_layer_norm_before=false)": not c.get("do_layer_norm_before", True),
        "word_embed_proj_dim != hidden_size": c.get("word_embed_proj_dim", hidden) != hidden,
        f"activation_function {c.get('activation_function')!r}": c.get("activation_function", "relu") != "relu",
        "no final layer norm (_remove_final_layer_norm=true)": c.get("_remove_final_layer_norm", False),
        "LayerNorms without weights (layer_norm_elementwise_affine=false)":
            not c.get("layer_norm_elementwise_affine", True),
    })
    arch = "opt"
    return arch, {
        f"{arch}.context_length": int(c.get("max_position_embeddings", 2048)),
        f"{arch}.embedding_length": int(hidden),
        f"{arch}.block_count": int(c["num_hidden_layers"]),
        f"{arch}.feed_forward_length": int(c["ffn_dim"]),
        f"{arch}.attention.head_count": int(c["num_attention_heads"]),
        f"{arch}.attention.layer_norm_epsilon": 1e-5,  # torch's LayerNorm default, which OPT uses
        f"{arch}.vocab_size": int(c["vocab_size"]),
        ACTIVATION_KEY: FFNActivation.RELU.value,
    }


def opt_tensors(ckpt: HFCheckpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every weight, named as PowerInfer's OPT."""
    tied = ckpt.config.get("tie_word_embeddings", True)
    for hf_name, tensor in ckpt.tensors():
        if tied and hf_name == "lm_head.weight":
            continue
        base, _, kind = hf_name.removeprefix("model.").rpartition(".")
        block = _OPT_BLOCK.fullmatch(base)
        if base in OPT_TENSORS:
            name = OPT_TENSORS[base]
        elif block and block.group(2) in OPT_BLOCK_TENSORS:
            name = f"blk.{block.group(1)}.{OPT_BLOCK_TENSORS[block.group(2)]}"
        else:
            raise UnsupportedModelError(f"{ckpt.folder}: cannot map tensor {hf_name!r}")
        yield f"{name}.{kind}", tensor.numpy()


# Hugging Face architecture class -> (metadata, tensors) readers.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": (llama_metadata, llama_tensors),
    "MistralForCausalLM": (llama_metadata, llama_tensors),
    "MixtralForCausalLM": (mixtral_metadata, mixtral_tensors),
    "Qwen2ForCausalLM": (partial(llama_metadata, arch="qwen2"), partial(llama_tensors, arch=MODEL_ARCH.QWEN2)),
    "Qwen3ForCausalLM": (partial(llama_metadata, arch="qwen3"), partial(llama_tensors, arch=MODEL_ARCH.QWEN3)),
    "Gemma3ForCausalLM": (gemma3_metadata, gemma3_tensors),
    "Phi3ForCausalLM": (phi3_metadata, phi3_tensors),
    "FalconForCausalLM": (falcon_metadata, falcon_tensors),
    "OPTForCausalLM": (opt_metadata, opt_tensors),
}


def hf_source(folder: str | Path) -> ModelSource:
    """A Hugging Face checkpoint folder as a conversion source."""
    ckpt = HFCheckpoint.open(folder)
    readers = HF_ARCHITECTURES.get(ckpt.architecture_class)
    if readers is None:
        raise UnsupportedModelError(f"{ckpt.folder}: unsupported architecture {ckpt.architecture_class} "
                                    f"(supported: {', '.join(HF_ARCHITECTURES)})")
    read_metadata, read_tensors = readers
    try:
        arch, meta = read_metadata(ckpt)
        n_vocab = int(ckpt.config["vocab_size"])
    except KeyError as error:
        raise ModelFileError(f"{ckpt.folder / 'config.json'}: {error.args[0]!r} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as error:
        raise ModelFileError(f"{ckpt.folder / 'config.json'}: invalid values ({error})") from None
    meta["general.name"] = ckpt.folder.name
    meta.update(tokenizer_metadata(ckpt.folder, n_vocab=n_vocab))
    return ModelSource(ckpt.folder, arch, meta, {}, read_tensors(ckpt),
                       *(int(meta[f"{arch}.{k}"]) for k in ("block_count", "embedding_length", "feed_forward_length")))


def convert_hf(folder: str | Path, outfile: str | Path, outtype: GGMLQuantizationType, progress: bool = True) -> None:
    """Convert a Hugging Face checkpoint folder to a GGUF file."""
    write_model(hf_source(folder), outfile, outtype, progress=progress)
