"""What `powerinfer show` tells about a model file, read from its header alone (no weights loaded):
as `ollama show` and gguf-dump do, plus PowerInfer's sparsity parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType

from powerinfer.chat_formats import detect
from powerinfer.errors import PowerInferError
from powerinfer.gguf.file_type import file_type_label
from powerinfer.gguf.reader import GGUFFile, open_gguf
from powerinfer.models import read_config
from powerinfer.placement.gpu_index import BLOCK_COUNT_KEY, CAPACITY_KEY, POWERINFER_I32, index_path
from powerinfer.sparse.ffn import ACTIVATION_THRESHOLDS_KEY
from powerinfer.sparse.predictor import LAYER_THRESHOLDS_KEY, SPARSE_THRESHOLD_KEY

PREDICTOR_PARTS = (".fc1.", ".fc2.")


def _is_predictor(name: str) -> bool:
    return any(part in name for part in PREDICTOR_PARTS)


def quantization_mix(gguf: GGUFFile) -> list[dict[str, Any]]:
    """Per tensor type: how many tensors and bytes, the largest share first."""
    mix: dict[str, dict[str, Any]] = {}
    for tensor in gguf.tensors.values():
        entry = mix.setdefault(tensor.ggml_type.name, {"type": tensor.ggml_type.name, "tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += tensor.n_bytes
    total = sum(e["bytes"] for e in mix.values()) or 1
    for entry in mix.values():
        entry["share"] = round(entry["bytes"] / total, 4)
    return sorted(mix.values(), key=lambda e: -e["bytes"])


def _tokenizer(gguf: GGUFFile) -> dict[str, Any]:
    tokens = gguf.get("tokenizer.ggml.tokens") or []

    def piece(key: str) -> str | None:
        index = gguf.get(key)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    return {"model": gguf.get("tokenizer.ggml.model"), "pre": gguf.get("tokenizer.ggml.pre"), "tokens": len(tokens),
            "bos": piece("tokenizer.ggml.bos_token_id"), "eos": piece("tokenizer.ggml.eos_token_id")}


def _chat_template(gguf: GGUFFile) -> dict[str, Any]:
    source = gguf.get("tokenizer.chat_template")
    if source:
        return {"origin": "the model file", "characters": len(source), "template": source}
    vocabulary = set(gguf.get("tokenizer.ggml.tokens") or [])
    name = detect(str(gguf.get("general.architecture", "")), vocabulary.__contains__)
    return {"origin": f"built-in {name} (the file has none)", "characters": 0, "template": None}


def _sparsity(gguf: GGUFFile, path: Path) -> dict[str, Any]:
    fc1 = [t for name, t in gguf.tensors.items() if name.startswith("blk.") and ".fc1." in name]  # per FFN unit
    ranks = sorted({t.shape[0] for t in fc1})
    layer_thresholds = gguf.get(LAYER_THRESHOLDS_KEY)
    index = index_path(path)
    described: dict[str, Any] = {
        "powerinfer_file": gguf.is_powerinfer,
        "predictors": {"ffn_units": len(fc1), "ranks": ranks} if fc1 else None,
        "predictor_threshold": None if layer_thresholds else gguf.get(SPARSE_THRESHOLD_KEY),
        "predictor_thresholds": layer_thresholds,
        "activation_thresholds": gguf.get(ACTIVATION_THRESHOLDS_KEY),
        "gpu_index": None,
    }
    if index.is_file():
        stored = open_gguf(index, type_codes={POWERINFER_I32: GGMLQuantizationType.I32})
        hot = sum(t.n_elements for name, t in stored.tensors.items() if name.endswith(".gpu_bucket"))
        described["gpu_index"] = {"path": str(index), "vram_capacity_bytes": stored.get(CAPACITY_KEY),
                                  "layers": stored.get(BLOCK_COUNT_KEY), "neurons_on_accelerator": hot}
    return described


def describe(path: Path) -> dict[str, Any]:
    """Everything `show` prints, as plain data (its --json output)."""
    gguf = open_gguf(path)
    try:
        config, unsupported = read_config(gguf), None
    except PowerInferError as error:  # still worth showing what the file says
        config, unsupported = None, str(error)
    parameters = sum(t.n_elements for name, t in gguf.tensors.items() if not _is_predictor(name))
    model: dict[str, Any] = {
        "path": str(path), "file_size": gguf.file_size, "format": gguf.magic,
        "name": gguf.get("general.name", path.stem), "architecture": gguf.get("general.architecture"),
        "parameters": parameters, "quantization": file_type_label(gguf), "runs_here": unsupported is None,
    }
    if config is not None:
        model.update(context_length=config.n_ctx_train, embedding_length=config.n_embd, layers=config.n_layers,
                     heads=config.n_head, kv_heads=config.n_head_kv, feed_forward_length=config.n_ff,
                     experts=config.n_expert, ffn_activation=config.activation.value, vocabulary=config.n_vocab)
    else:
        model["unsupported"] = unsupported
    return {"model": model, "quantization_mix": quantization_mix(gguf), "tokenizer": _tokenizer(gguf),
            "chat_template": _chat_template(gguf), "sparsity": _sparsity(gguf, path)}


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _thresholds(values: list[float] | None) -> str | None:
    if not values:
        return None
    return f"{len(values)} values, {min(values):g} ... {max(values):g}"


def as_text(info: dict[str, Any]) -> str:
    """The description as aligned sections, as `ollama show` prints one."""
    m, tok, chat, sparse = info["model"], info["tokenizer"], info["chat_template"], info["sparsity"]
    sections: dict[str, list[tuple[str, Any]]] = {
        "Model": [("name", m["name"]), ("architecture", m["architecture"]), ("parameters", _count(m["parameters"])),
                  ("context length", m.get("context_length")), ("embedding length", m.get("embedding_length")),
                  ("layers", m.get("layers")), ("heads (kv)", m.get("heads") and f"{m['heads']} ({m['kv_heads']})"),
                  ("feed forward length", m.get("feed_forward_length")), ("experts", m.get("experts") or None),
                  ("ffn activation", m.get("ffn_activation")), ("quantization", m["quantization"]),
                  ("file", f"{m['path']} ({m['format']}, {_bytes(m['file_size'])})"), ("unsupported", m.get("unsupported"))],
        "Quantization mix": [(e["type"], f"{e['tensors']:4d} tensors  {_bytes(e['bytes']):>11}  {e['share']:6.1%}")
                             for e in info["quantization_mix"]],
        "Tokenizer": [("model", tok["model"]), ("pre-tokenizer", tok["pre"]), ("tokens", tok["tokens"]),
                      ("bos / eos", f"{tok['bos']} / {tok['eos']}")],
        "Chat template": [("from", chat["origin"]), ("length", f"{chat['characters']} characters" if chat["template"] else None)],
    }
    predictors = sparse["predictors"]
    sections["Sparsity"] = [
        ("predictors", f"{predictors['ffn_units']} FFNs, ranks {', '.join(map(str, predictors['ranks']))}"
         if predictors else "none (dense unless --sparsity oracle)"),
        ("predictor threshold", sparse["predictor_threshold"]),
        ("predictor thresholds", _thresholds(sparse["predictor_thresholds"])),
        ("activation thresholds", _thresholds(sparse["activation_thresholds"])),
        ("gpu index", "none" if sparse["gpu_index"] is None else
         f"{sparse['gpu_index']['path']} ({sparse['gpu_index']['neurons_on_accelerator']} neurons, "
         f"{_bytes(sparse['gpu_index']['vram_capacity_bytes'] or 0)} budget)"),
    ]
    lines = []
    for title, rows in sections.items():
        lines.append(f"  {title}")
        lines += [f"    {key:<24}{value}" for key, value in rows if value is not None]
        lines.append("")
    return "\n".join(lines)
