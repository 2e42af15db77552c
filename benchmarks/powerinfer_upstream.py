"""The original PowerInfer, from its source tree: a CPU-only build, its commit, and a test file made
by its own converter and quantizer.

    .venv/bin/python benchmarks/powerinfer_upstream.py --powerinfer ~/src/PowerInfer --out relu-7bw-8l.q4_0.powerinfer.gguf

`--powerinfer` is a PowerInfer source tree (`git clone https://github.com/SJTU-IPADS/PowerInfer`).
Nothing of it is copied into this repository: its tools run from that tree, and its build goes to
`<powerinfer>/build` (`main`, `quantize`), or `<powerinfer>/build-avx2` with `--isa avx2`.

The file: a 7B-width (n_embd 4096, n_ff 11008, 32 heads) ReLU llama with 8 layers and random
weights (transformers' LlamaForCausalLM, `save_pretrained`), llama's 32000-token SentencePiece
vocabulary, and synthetic predictors that select about `--active` of the neurons of every token;
then PowerInfer's `convert.py` (a float16 PowerInfer GGUF) and its `quantize ... Q4_0`, which writes
`output.weight` as Q6_K and the predictors (`fc1`, `fc2`) as Q4_0. The types the file holds are
printed (read with the gguf package). Its convert.py predates NumPy 2 (`np.uint32(1).newbyteorder`),
so it runs in a venv of its own with `numpy<2` and `sentencepiece` (its requirements.txt), made on
first use in `<powerinfer>/build/convert-venv`. Scratch files (the checkpoint, predictors and the
float16 GGUF, ~4 GB) go to a temporary folder beside the output and are removed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from functools import cache
from pathlib import Path

import torch

N_EMBD, N_FF, N_HEAD, N_VOCAB = 4096, 11008, 32, 32000
BINARIES = ("main", "quantize")


# ---------------------------------------------------------------- the build

def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


# The instruction sets a build may be limited to (--isa): AVX2 means AVX, AVX2, FMA and F16C, and no
# AVX-512, as on every AMD chip before Zen 4 and Intel's desktop chips since the 12th generation.
ISAS = ("avx2",)


def cmake_flags(isa: str | None = None) -> list[str]:
    """CPU-only, Release, the instruction sets this CPU has, named one by one: not -march=native,
    so that the same build serves on the Intel Xeons with AMX (where llama.cpp's native build
    crashes; this Dec-2023 ggml has no AMX code, but nothing is left to chance). `isa="avx2"` turns
    AVX-512 off whatever the CPU has, to compare with our AVX2 path on any machine."""
    have = cpu_flags()
    if isa == "avx2":
        have = {flag for flag in have if not flag.startswith("avx512")}
    on = lambda flag, *needs: f"-D{flag}={'ON' if all(n in have for n in needs) else 'OFF'}"  # noqa: E731
    return ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CUBLAS=OFF", "-DLLAMA_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", on("LLAMA_AVX", "avx"), on("LLAMA_AVX2", "avx2"), on("LLAMA_FMA", "fma"),
            on("LLAMA_F16C", "f16c"), on("LLAMA_AVX512", "avx512f", "avx512bw"),
            on("LLAMA_AVX512_VBMI", "avx512vbmi"), on("LLAMA_AVX512_VNNI", "avx512_vnni")]


def build_dir(powerinfer: Path, isa: str | None = None) -> Path:
    """One build folder per instruction-set choice, so that a native build is never taken for an AVX2 one."""
    return powerinfer / ("build" if isa is None else f"build-{isa}")


def binary(powerinfer: Path, name: str, isa: str | None = None) -> Path:
    return build_dir(powerinfer, isa) / "bin" / name


def build(powerinfer: Path, isa: str | None = None) -> None:
    """Configure and build PowerInfer's `main` and `quantize` (CPU only) unless they are built."""
    if all(binary(powerinfer, name, isa).exists() for name in BINARIES):
        return
    if not (powerinfer / "CMakeLists.txt").exists() or not (powerinfer / "convert.py").exists():
        sys.exit(f"{powerinfer} is not a PowerInfer source tree (git clone https://github.com/SJTU-IPADS/PowerInfer)")
    log = build_dir(powerinfer, isa) / "powerinfer-build.log"
    log.parent.mkdir(exist_ok=True)
    print(f"building PowerInfer (CPU only) in {log.parent}, log in {log} ...", file=sys.stderr)
    with log.open("w") as out:
        for command in (["cmake", "-S", str(powerinfer), "-B", str(log.parent), *cmake_flags(isa)],
                        ["cmake", "--build", str(log.parent), "--config", "Release", "-j", str(os.cpu_count()),
                         "--target", *BINARIES]):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                sys.exit(f"PowerInfer's build failed: see {log}")


@cache
def commit(powerinfer: Path) -> str | None:
    """The checked-out commit of a git clone (None for a tree without git metadata)."""
    result = subprocess.run(["git", "-C", str(powerinfer), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


# ---------------------------------------------------------------- the test file


def sentencepiece_model(vocab_gguf: Path) -> bytes:
    """llama's SentencePiece model (tokenizer.model) rebuilt from a GGUF vocabulary file.

    PowerInfer's convert.py reads the vocabulary from tokenizer.model; its source tree carries
    llama's vocabulary (pieces, scores, token types) as models/ggml-vocab-llama.gguf. GGUF's token
    types number the same kinds as SentencePiece's piece types (normal 1, unknown 2, control 3,
    byte 6)."""
    from gguf import GGUFReader
    from sentencepiece import sentencepiece_model_pb2 as spm

    reader = GGUFReader(vocab_gguf)

    def values(key: str) -> list:
        field = reader.fields[key]
        return [field.contents(i) for i in range(len(field.data))]

    model = spm.ModelProto()
    for piece, score, kind in zip(values("tokenizer.ggml.tokens"), values("tokenizer.ggml.scores"),
                                  values("tokenizer.ggml.token_type")):
        model.pieces.add(piece=piece, score=score, type=kind)
    # llama's settings: BPE with byte fallback, a space marker prepended, ids unk 0, bos 1, eos 2
    model.trainer_spec.model_type = spm.TrainerSpec.BPE
    model.trainer_spec.vocab_size = len(model.pieces)
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.unk_id, model.trainer_spec.bos_id, model.trainer_spec.eos_id = 0, 1, 2
    model.trainer_spec.pad_id = -1
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = True
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    return model.SerializeToString()


def save_checkpoint(directory: Path, n_layers: int, vocab_gguf: Path, seed: int) -> None:
    """A random-weight ReLU LlamaForCausalLM (float16) with llama's tokenizer.model, as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=N_VOCAB, hidden_size=N_EMBD, intermediate_size=N_FF, num_hidden_layers=n_layers,
                         num_attention_heads=N_HEAD, num_key_value_heads=N_HEAD, hidden_act="relu",
                         max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # built in float16 directly: 1.9 B parameters
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(directory, max_shard_size="100GB")
    (directory / "tokenizer.model").write_bytes(sentencepiece_model(vocab_gguf))


def synthetic_predictors(n_layers: int, rank: int, active: float, seed: int):
    """Predictors (PowerInfer's shape: fc2 @ relu(fc1 @ x), no biases) whose score is >= 0 for about
    `active` of the neurons, for any input.

    fc1 is Gaussian, so h = relu(fc1 @ x) has R independent half-normal entries whatever x is; fc2's
    entries are Gaussian with mean mu and deviation sigma, so a neuron's score is Gaussian with mean
    mu * sum(h) and deviation sigma * |h|. sum(h) / |h| is close to sqrt(R / pi), so
    mu / sigma = Phi^-1(active) * sqrt(pi / R) gives P(score >= 0) = active."""
    from powerinfer.sparse.predictor_training import TrainedPredictor

    generator = torch.Generator().manual_seed(seed)
    z = statistics.NormalDist().inv_cdf(active)
    mu_over_sigma = z * math.sqrt(math.pi / rank)
    predictors = []
    for _ in range(n_layers):
        fc1 = torch.randn(rank, N_EMBD, generator=generator) / math.sqrt(N_EMBD)
        fc2 = (torch.randn(N_FF, rank, generator=generator) + mu_over_sigma) / math.sqrt(rank)
        predictors.append(TrainedPredictor(fc1, fc2, threshold=0.0))
    return predictors


def tensor_types(path: Path) -> Counter:
    """How many tensors of each (kind, type) the file holds; kind is the name without its layer."""
    from powerinfer.gguf.reader import open_gguf

    kinds: Counter = Counter()
    for tensor in open_gguf(path).tensors.values():
        kind = ".".join(part for part in tensor.name.split(".") if not part.isdigit() and part != "blk")
        kinds[(kind, tensor.ggml_type.name)] += 1
    return kinds


def converter_python(powerinfer: Path) -> Path:
    """A Python for PowerInfer's convert.py: a venv with the NumPy 1.x it was written for."""
    venv = powerinfer / "build" / "convert-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"making {venv} (numpy<2, sentencepiece) for PowerInfer's convert.py ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "numpy<2",
                        "sentencepiece"], check=True)
    return python


def make_model(powerinfer: Path, out: Path, n_layers: int = 8, rank: int = 1024, active: float = 0.1,
               seed: int = 0, isa: str | None = None) -> None:
    """Write the test file to `out` (see the module's docstring); it appears only when complete."""
    from powerinfer.sparse.predictor_training import save_predictors

    build(powerinfer, isa)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".powerinfer-model-") as scratch:
        scratch = Path(scratch)
        checkpoint, predictors, f16 = scratch / "hf", scratch / "predictors", scratch / "model.powerinfer.gguf"
        print("writing the random-weight checkpoint ...", file=sys.stderr)
        save_checkpoint(checkpoint, n_layers, powerinfer / "models" / "ggml-vocab-llama.gguf", seed)
        save_predictors(predictors, synthetic_predictors(n_layers, rank, active, seed + 1))
        print("PowerInfer convert.py ...", file=sys.stderr)
        subprocess.run([str(converter_python(powerinfer)), str(powerinfer / "convert.py"), "--outfile", str(f16), str(checkpoint),
                        str(predictors)], check=True, stdout=subprocess.DEVNULL)
        print("PowerInfer quantize Q4_0 ...", file=sys.stderr)
        quantized = scratch / "model.q4_0.powerinfer.gguf"
        subprocess.run([str(binary(powerinfer, "quantize", isa)), str(f16), str(quantized), "Q4_0"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(quantized, out)
    for (kind, type_name), count in sorted(tensor_types(out).items()):
        print(f"{kind:24s} {type_name:6s} x{count}")
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--powerinfer", type=Path, required=True, help="PowerInfer source tree (built here if needed)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=1024, help="predictor rank R (a multiple of 32, for Q4_0)")
    parser.add_argument("--active", type=float, default=0.1, help="fraction of neurons the predictors select")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--isa", choices=ISAS, help="build PowerInfer for this instruction set only (default: the CPU's)")
    args = parser.parse_args()
    make_model(args.powerinfer.resolve(), args.out.resolve(), args.layers, args.rank, args.active, args.seed, args.isa)


if __name__ == "__main__":
    main()
