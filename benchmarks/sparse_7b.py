"""Input sparsity at 7B width: decode speed of a sparsified model against its dense source.

    .venv/bin/python benchmarks/sparse_7b.py [--types Q4_0 Q4_K_M] [--sparsity 0.4 0.5] [--threads 2]

The model: Llama-2-7B's widths (4096 hidden, 11008 FFN, 32 heads, SwiGLU), 8 layers, random
weights written straight into blocks (`ops.quant.random_blocks`) in the types llama-quantize gives
each tensor (Q4_0: Q4_0 everywhere, the output head Q6_K; Q4_K_M: llama.cpp's mix). The vocabulary is
the default model's (49152 tokens: its tokenizer is at hand; Llama-2's head has 32000 rows, so this
one reads more dense bytes per token than Llama-2's would). Each target sparsity is calibrated on
wikitext-2 valid (`sparsify`, TEAL's uniform thresholds: random weights give the allocation nothing
to find) and written as its own file.

Speed: `Engine` single-token decode steps after a short prompt, and a 512-token prompt's prefill
(every channel of each row's selection through the dense kernels: sparse_input.cpp), the dense and
sparse files loaded once, runs interleaved, each sparse run against the dense run beside it. Bytes per
token: what each file's linears read (the column layouts' share of channels measured over the decoded
tokens). The files are cached in
~/.cache/powerinfer/bench. Results: benchmarks/results/sparse_7b.md.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import numpy as np
import torch

from powerinfer import LLM
from powerinfer.convert.encode import FILE_TYPES
from powerinfer.convert.mixes import ModelFacts, parse_mix
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.hub import pull_default_model
from powerinfer.ops import native
from powerinfer.ops.quant import T, random_blocks
from powerinfer.sparse.payoff import decode_rate
from powerinfer.sparse.sparsify import Target, sparsify

from common import (
    LLAMA_CPP_BUILDS,
    bytes_per_token,
    interleaved,
    machine_description,
    memory_read_rate,
    paired_ratio,
    prefill_rate,
    wikitext,
)

N_EMBD, N_FF, N_HEAD, N_LAYERS = 4096, 11008, 32, 8
RESULTS = Path(__file__).parent / "results"
MODELS = LLAMA_CPP_BUILDS


def tensor_shapes(n_vocab: int) -> dict[str, tuple[int, int]]:
    """Every matrix of the model, torch order [rows, cols]."""
    shapes = {"token_embd.weight": (n_vocab, N_EMBD), "output.weight": (n_vocab, N_EMBD)}
    for i in range(N_LAYERS):
        for name, shape in (("attn_q", (N_EMBD, N_EMBD)), ("attn_k", (N_EMBD, N_EMBD)), ("attn_v", (N_EMBD, N_EMBD)),
                            ("attn_output", (N_EMBD, N_EMBD)), ("ffn_gate", (N_FF, N_EMBD)), ("ffn_up", (N_FF, N_EMBD)),
                            ("ffn_down", (N_EMBD, N_FF))):
            shapes[f"blk.{i}.{name}.weight"] = shape
    return shapes


def matrix_type(kind: str, name: str, width: int) -> T:
    if kind == "Q4_0":
        return T.Q6_K if name == "output.weight" else T.Q4_0
    facts = ModelFacts("llama", N_LAYERS, tied_embeddings=False, n_expert=1, llama_70b=False)
    return parse_mix(kind).matrix_type(name, width, facts)


def make_dense(kind: str, path: Path) -> None:
    """The random model in `kind`'s types (see the module's note), with the default model's tokenizer."""
    tokenizer_file = open_gguf(pull_default_model(quiet=True))
    metadata = {key: value for key, value in tokenizer_file.metadata.items() if key.startswith("tokenizer.")}
    typed = {key: (value, *tokenizer_file.value_types[key]) for key, value in metadata.items()}
    n_vocab = len(metadata["tokenizer.ggml.tokens"])
    config = {"llama.block_count": N_LAYERS, "llama.embedding_length": N_EMBD, "llama.feed_forward_length": N_FF,
              "llama.attention.head_count": N_HEAD, "llama.attention.head_count_kv": N_HEAD,
              "llama.context_length": 4096, "llama.rope.dimension_count": N_EMBD // N_HEAD,
              "llama.attention.layer_norm_rms_epsilon": 1e-5, "general.name": f"random 7B-width {kind}",
              "general.file_type": int(FILE_TYPES[T.Q4_0] if kind == "Q4_0" else parse_mix(kind).file_type)}
    rng = np.random.default_rng(0)

    def tensors():
        yield TensorData("output_norm.weight", np.ones(N_EMBD, np.float32), T.F32)
        for i in range(N_LAYERS):
            for norm in ("attn_norm", "ffn_norm"):
                yield TensorData(f"blk.{i}.{norm}.weight", np.ones(N_EMBD, np.float32), T.F32)
        for name, (rows, cols) in tensor_shapes(n_vocab).items():
            ggml_type = matrix_type(kind, name, cols)
            # small scales: every block's integer fields are random (K-quants' sub-scales up to 127), and
            # float16 caches and float32 sums must not overflow; each block's input is normalized anyway
            yield TensorData(name, random_blocks(ggml_type, rows, cols, rng, scale=1e-4), ggml_type)

    write_gguf(path, "llama", config, tensors(), typed_metadata=typed, progress=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"])
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.4, 0.5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-gen", type=int, default=32)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill timing (0: none)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sparse_7b.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    MODELS.mkdir(parents=True, exist_ok=True)
    calibration = wikitext("valid.txt")
    memory_before = memory_read_rate()
    lines = []
    for kind in args.types:
        dense_path = MODELS / f"llama-7bw-8l.{kind.lower()}.gguf"
        if not dense_path.exists():
            make_dense(kind, dense_path)
        files = {"dense": dense_path}
        for target in args.sparsity:
            path = MODELS / f"llama-7bw-8l.{kind.lower()}.sparse{round(target * 100)}.gguf"
            if not path.exists():
                sparsify(LLM(dense_path, sparsity="off"), calibration, path, Target(sparsity=target), n_tokens=2048,
                         method="uniform", all_sites=True)  # the columns' speed, whether or not they pay
            files[f"{target:.0%}"] = path
        llms = {label: LLM(path) for label, path in files.items()}
        prompt = llms["dense"].tokenize("The tower is 324 metres tall, about the same height as")
        long_prompt = llms["dense"].tokenize(calibration[:40_000])[:args.prefill]
        rates: dict[str, list[float]] = {label: [] for label in llms}
        prefill: dict[str, list[float]] = {label: [] for label in llms}
        for rep in range(args.reps + 1):  # the first round warms up
            order = interleaved(list(llms), rep)
            for label in order:  # the decode runs of a repetition back to back, then its prefills
                rate = decode_rate(llms[label], prompt, args.n_gen)
                if rep:
                    rates[label].append(rate)
            if rep and long_prompt:
                for label in order:
                    prefill[label].append(prefill_rate(llms[label], long_prompt))
        for label, llm in llms.items():
            ratio, low, high = paired_ratio(rates[label], rates["dense"])
            prefill_cells = (f"{statistics.median(prefill[label]):.1f} | "
                             f"{paired_ratio(prefill[label], prefill['dense'])[0]:.2f}x" if long_prompt else "- | -")
            lines.append(f"| {kind} | {label} | {statistics.median(rates[label]):.2f} | {ratio:.2f}x | "
                         f"{low:.2f}-{high:.2f} | {bytes_per_token(llm, prompt, args.n_gen) / 1e6:.0f} | {prefill_cells} |")
            print(lines[-1], flush=True)
    header = (f"# Input sparsity at 7B width: decode tok/s, sparsified vs dense\n\n"
              f"Measured {datetime.date.today()} on {machine_description()}; {args.threads} threads; kernels "
              f"{native.kernels_label() if native.load() else 'plain torch'}; {args.n_gen} tokens per run, "
              f"{args.reps} interleaved repetitions (ABBA order): tok/s their median; vs dense the median of each "
              f"repetition's ratio to the dense run beside it, and those ratios' quartiles. Memory read "
              f"{memory_before} before the runs, {memory_read_rate()} after.\n\n"
              + (f"Prefill: a {args.prefill}-token prompt (wikitext-2 valid) from an empty cache, in the same "
                 f"repetitions, medians as decode's.\n\n" if args.prefill else "")
              + "| types | sparsity | decode tok/s | vs dense | quartiles | MB read per token | prefill tok/s | vs dense |\n"
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    args.out.write_text(header + "\n".join(lines) + f"\n\nCommand: `.venv/bin/python benchmarks/sparse_7b.py "
                        f"--types {' '.join(args.types)} --sparsity {' '.join(map(str, args.sparsity))} --n-gen {args.n_gen} "
                        f"--reps {args.reps} --prefill {args.prefill}`\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
