"""Our quantizer against llama.cpp's (llama-cpp-python's `llama_model_quantize`) on the same F16 files.

For each source and file type both tools quantize the same F16 GGUF; every tensor of both results
is decoded with `gguf.quants.dequantize` and compared with the source. Reported per tensor type:
the RMS error of each tool over all tensors of that type, and their ratio; and whether both tools
chose the same type for every tensor.

    .venv/bin/python benchmarks/quantize_error.py        # installs llama-cpp-python if missing

Sources: SmolLM2-135M (the default model, dequantized from Q4_1 to F16: real weight statistics,
but its values sit on a Q4_1 grid, and most of its rows are 576 wide, not whole 256-value
super-blocks), and a random transformers llama whose rows are all whole super-blocks.
Writes benchmarks/results/quantize_error.md.
"""

from __future__ import annotations

import ctypes
import datetime
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LLAMA_CPP_PYTHON, ensure_llama_cpp, machine_description  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "quantize_error.md"
# (our type name, llama.cpp file type name, llama.cpp's `pure`: every matrix the base type)
RUNS = [("Q4_K_M", "Q4_K_M", False), ("Q5_K_M", "Q5_K_M", False), ("Q4_K", "Q4_K_M", True),
        ("Q5_K", "Q5_K_M", True), ("Q6_K", "Q6_K", True)]


def smollm2_f16(folder: Path) -> Path:
    from powerinfer.convert.model import gguf_source, write_model
    from powerinfer.hub import pull_default_model

    path = folder / "smollm2-135m-f16.gguf"
    write_model(gguf_source(pull_default_model(quiet=True)), path, GGMLQuantizationType.F16, progress=False)
    return path


def random_llama_f16(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from powerinfer.convert.hf import convert_hf

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=12, num_key_value_heads=4, initializer_range=0.02)
    LlamaForCausalLM(config).save_pretrained(folder / "random-llama")
    path = folder / "random-llama-f16.gguf"
    convert_hf(folder / "random-llama", path, GGMLQuantizationType.F16, progress=False)
    return path


def quantize_llama_cpp(source: Path, target: Path, ftype: str, pure: bool) -> float:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.pure = pure
    params.nthread = 2
    start = time.perf_counter()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    return time.perf_counter() - start


def quantize_ours(source: Path, target: Path, kind: str) -> float:
    from powerinfer.convert.mixes import parse_mix
    from powerinfer.convert.model import gguf_source, write_model

    start = time.perf_counter()
    write_model(gguf_source(source), target, parse_mix(kind), progress=False)
    return time.perf_counter() - start


def decoded(reader: GGUFReader) -> dict[str, tuple[str, np.ndarray]]:
    return {t.name: (t.tensor_type.name, quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1))
            for t in reader.tensors if len(t.shape) > 1}


def compare(source: Path, ours: Path, theirs: Path) -> tuple[list[tuple], list[str]]:
    """Rows (type, tensors, llama.cpp RMS, our RMS) per tensor type, and type disagreements."""
    reference, a, b = decoded(GGUFReader(source)), decoded(GGUFReader(ours)), decoded(GGUFReader(theirs))
    sums: dict[str, list[float]] = {}
    differences = []
    for name, (_, x) in reference.items():
        (our_type, ours_x), (their_type, theirs_x) = a[name], b[name]
        if our_type != their_type:
            differences.append(f"{name}: ours {our_type}, llama.cpp {their_type}")
            continue
        entry = sums.setdefault(our_type, [0, 0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += x.size
        entry[2] += float(np.sum((theirs_x - x) ** 2, dtype=np.float64))
        entry[3] += float(np.sum((ours_x - x) ** 2, dtype=np.float64))
    rows = [(t, n, np.sqrt(theirs / count), np.sqrt(ours / count)) for t, (n, count, theirs, ours) in sorted(sums.items())]
    return rows, differences


def main() -> int:
    ensure_llama_cpp()
    import llama_cpp

    silence = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(silence, ctypes.c_void_p(0))
    lines = [f"# Quantization error: ours vs llama.cpp ({datetime.date.today()})", "",
             f"`.venv/bin/python benchmarks/quantize_error.py` on {machine_description()}, "
             f"llama.cpp from {LLAMA_CPP_PYTHON} (`llama_model_quantize`, no importance matrix).",
             "RMS error of the decoded weights against the F16 source, over all tensors of a type.", ""]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label, make in (("SmolLM2-135M (from Q4_1)", smollm2_f16), ("random llama, 768 wide", random_llama_f16)):
            source = make(folder)
            lines += [f"## {label}", "", "| our type | llama.cpp | tensor type | tensors | llama.cpp RMS | our RMS | ours / llama.cpp | seconds (llama.cpp, ours) |",
                      "|---|---|---|---:|---:|---:|---:|---|"]
            notes = []
            for ours_kind, ftype, pure in RUNS:
                theirs_path, ours_path = folder / f"theirs-{ours_kind}.gguf", folder / f"ours-{ours_kind}.gguf"
                their_seconds = quantize_llama_cpp(source, theirs_path, ftype, pure)
                our_seconds = quantize_ours(source, ours_path, ours_kind)
                rows, differences = compare(source, ours_path, theirs_path)
                for ggml_type, n, theirs, ours in rows:
                    lines.append(f"| {ours_kind} | {ftype}{' --pure' if pure else ''} | {ggml_type} | {n} | {theirs:.3e} | "
                                 f"{ours:.3e} | {ours / theirs:.3f} | {their_seconds:.1f}, {our_seconds:.1f} |")
                    print(lines[-1], file=sys.stderr)
                notes.append(f"- {ours_kind}: " + ("same type for every tensor" if not differences else
                                                   f"{len(differences)} tensors differ: " + "; ".join(differences[:5])))
            lines += ["", *notes, ""]
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
