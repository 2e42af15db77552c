"""Hybrid CPU/GPU decoding of a 7B-shaped ReLU-llama Q4_0 model under a VRAM budget, against
Hugging Face `accelerate` offloading and our CPU-only mode, in one run on one machine.

    python benchmarks/hybrid_offload.py --workdir /tmp/hybrid            # 7B shape, CUDA, 30 % budget
    python benchmarks/hybrid_offload.py --shape tiny --accelerator cpu   # a smoke test without a GPU

The model has random weights (speed does not depend on their values) in a PowerInfer GGUF: Q4_0
attention, FFN (ffn_gate, ffn_up, ffn_down_t) and output matrices, and per layer a predictor in
PowerInfer's shape (Linear d->R, ReLU, Linear R->n_ff) built so that on random inputs neuron j is
predicted active with probability about p_j, a power law over neurons (`solver.firing_probabilities`,
the law benchmarks/solver.py uses); those probabilities are written as the activation statistics the
placement solver reads. What the predictors select on the model's own hidden states is measured
and reported ("active"), as is the share of those activations that the GPU served.

Rows: our CPU-only mode (everything sparse on the CPU), our hybrid mode at each VRAM budget (a
share of the GGUF's weight bytes: dense parts first, then hot neurons, `docs/hybrid.md`), and
`accelerate` (transformers' LlamaForCausalLM in float16 with `device_map` and `max_memory`: the
layers that do not fit are kept in CPU memory and copied to the GPU for every token) given the same
share of its own weights. Decode tokens/s are measured on greedy steps after a short prompt. The
hybrid rows also report how far their logits are from the CPU-only mode's on the same prompt.
Writes benchmarks/results/hybrid_offload.md (or `--output`).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from solver import firing_probabilities  # noqa: E402

from common import machine_description  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "hybrid_offload.md"
SHAPES = {  # layers, n_embd, n_ff, heads, vocab
    "7b": (32, 4096, 11008, 32, 32000),
    "tiny": (4, 256, 704, 4, 1024),
}
Q4_0_BLOCK = 18  # bytes per 32 weights: a float16 scale and 16 bytes of nibbles


@dataclass
class Row:
    name: str
    budget_gib: float | None
    placed: str
    load_s: float
    tokens_per_s: float
    active: float | None = None  # predicted-active share of FFN neurons per token
    served: float | None = None  # share of those computed on the GPU
    logit_error: float | None = None  # max |logits - CPU-only logits| / max |CPU-only logits|


# ---------------------------------------------------------------- the synthetic model


def random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q4_0 blocks [rows, bytes] of random nibbles with one scale: weights of std ~ 1/sqrt(cols)."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, Q4_0_BLOCK), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(1.0 / (4.6 * math.sqrt(cols))).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def synthetic_predictor(p: np.ndarray, n_embd: int, rank: int, rng: np.random.Generator,
                        samples: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """fc1 [R, d], fc2 [n_ff, R] whose choice on random inputs fires neuron j with probability ~p[j].

    fc1 holds K pairs of opposite directions, whose ReLUs add up to |v.x|: a positive base B(x) that
    grows with |x|, and R - 2K random directions u(x). Neuron j scores g_j.u(x) - c_j B(x) (g_j
    random), so it fires when g_j.u/B >= c_j: c_j is that ratio's (1 - p_j) quantile over random x.
    """
    pairs = rank // 8
    torch.manual_seed(int(rng.integers(1 << 31)))
    v = torch.randn(pairs, n_embd)
    fc1 = torch.cat([v, -v, torch.randn(rank - 2 * pairs, n_embd)]) / math.sqrt(n_embd)
    h = torch.relu(torch.randn(samples, n_embd) @ fc1.T)
    g = torch.randn(len(p), rank - 2 * pairs)
    ratio = (h[:, 2 * pairs :] @ g.T) / h[:, : 2 * pairs].sum(1, keepdim=True)
    which = torch.from_numpy(np.rint((1 - p) * (samples - 1)).astype(np.int64))
    c = ratio.sort(dim=0).values.gather(0, which[None]).flatten()
    fc2 = torch.cat([-c[:, None].expand(-1, 2 * pairs), g], dim=1)
    return fc1.half().numpy(), fc2.half().numpy()


def make_model(path: Path, shape: tuple[int, ...], rank: int, firing_scale: float, seed: int = 0) -> None:
    """Write the PowerInfer GGUF and its activation statistics (activation/ next to it)."""
    from gguf import GGMLQuantizationType as T

    from powerinfer.gguf.writer import TensorData, write_gguf
    from powerinfer.sparse.profiler import ActivationProfile

    n_layers, d, n_ff, n_head, vocab = shape
    rng = np.random.default_rng(seed)
    ones = np.ones(d, dtype=np.float32)
    tensors = [TensorData("token_embd.weight", random_q4_0(rng, vocab, d), T.Q4_0)]
    probabilities = []
    for i in tqdm(range(n_layers), desc="making the model", unit="layer", file=sys.stderr):
        p = firing_probabilities(n_ff, firing_scale, rng)[rng.permutation(n_ff)]
        probabilities.append(p)
        fc1, fc2 = synthetic_predictor(p, d, rank, rng)
        tensors += [TensorData(f"blk.{i}.attn_norm.weight", ones, T.F32), TensorData(f"blk.{i}.ffn_norm.weight", ones, T.F32)]
        tensors += [TensorData(f"blk.{i}.{name}.weight", random_q4_0(rng, d, d), T.Q4_0)
                    for name in ("attn_q", "attn_k", "attn_v", "attn_output")]
        tensors += [TensorData(f"blk.{i}.{name}.weight", random_q4_0(rng, n_ff, d), T.Q4_0)
                    for name in ("ffn_gate", "ffn_up", "ffn_down_t")]
        tensors += [TensorData(f"blk.{i}.fc1.weight", fc1, T.F16), TensorData(f"blk.{i}.fc2.weight", fc2, T.F16)]
    tensors += [TensorData("output_norm.weight", ones, T.F32), TensorData("output.weight", random_q4_0(rng, vocab, d), T.Q4_0)]
    metadata = {"general.name": f"synthetic ReLU-llama {n_layers}x{d}", "general.file_type": 2,
                "llama.context_length": 4096, "llama.embedding_length": d, "llama.block_count": n_layers,
                "llama.feed_forward_length": n_ff, "llama.attention.head_count": n_head,
                "llama.attention.head_count_kv": n_head, "llama.rope.dimension_count": d // n_head,
                "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.vocab_size": vocab,
                "powerinfer.sparse_threshold": 0.0}
    write_gguf(path, "llama", metadata, tensors, powerinfer=True, progress=True)
    tokens = 10_000
    counts = [torch.from_numpy(np.rint(p * tokens).astype(np.int64)) for p in probabilities]
    ActivationProfile("relu", tokens, [0.0] * n_layers, counts).save(path.parent)


# ---------------------------------------------------------------- the engines


def release() -> None:
    """Free what the last engine held (its locals are gone once its run returns)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_speed(step, first_token: int, n_gen: int) -> tuple[float, list[torch.Tensor]]:
    """Tokens/s of `n_gen` greedy steps (after two warm-up steps); `step(token)` returns logits."""
    token, logits, times = first_token, [], []
    for _ in range(n_gen + 2):
        started = time.perf_counter()
        out = step(token)
        times.append(time.perf_counter() - started)
        logits.append(out)
        token = int(out.argmax())
    return 1.0 / statistics.median(times[2:]), logits


def run_ours(path: Path, prompt: list[int], n_gen: int, n_ctx: int, budget_gib: float | None,
             accelerator: str) -> tuple[Row, torch.Tensor]:
    from powerinfer.gguf import open_gguf
    from powerinfer.models import FFNOptions, load_model, read_config
    from powerinfer.placement.apply import apply_placement
    from powerinfer.placement.planner import choose_placement
    from powerinfer.runtime.engine import Engine
    from powerinfer.sparse.hybrid import HybridFFN

    started = time.perf_counter()
    gguf = open_gguf(path)  # the synthetic model has no tokenizer: built without `LLM`
    config = read_config(gguf)
    hybrid = None if budget_gib is None else choose_placement(
        gguf, config, path, n_ctx, 1, vram_budget=budget_gib, gpu_index="reset", accelerator=accelerator)
    model = load_model(gguf, n_ctx, FFNOptions(sparsity="auto"))
    if hybrid is not None:
        apply_placement(model, hybrid)
    engine = Engine(model, n_ctx)
    load_s = time.perf_counter() - started
    prompt_logits = engine.prefill(0, prompt)
    active, served = [], []

    def step(token: int) -> torch.Tensor:
        logits = engine.decode([(0, token)])[0]
        for block in model.blocks:
            ffn = block.ffn
            active.append(ffn.last_active / ffn.store.n_ff)
            if isinstance(ffn, HybridFFN) and ffn.last_active:
                served.append(ffn.last_on_accelerator / ffn.last_active)
        return logits

    speed, _ = decode_speed(step, int(prompt_logits.argmax()), n_gen)
    placed = "nothing" if hybrid is None else on_accelerator(hybrid)
    name = "powerinfer CPU only" if hybrid is None else "powerinfer hybrid"
    return Row(name, budget_gib, placed, load_s, speed, float(np.mean(active)),
               float(np.mean(served)) if served else (None if hybrid is None else 0.0)), prompt_logits


def on_accelerator(hybrid) -> str:
    """What a placement puts on the accelerator, in a few words."""
    neurons, total = sum(len(h) for h in hybrid.plan.hot), sum(hybrid.plan.n_ff)
    output = " + output head" if hybrid.dense.output else ""
    return (f"{len(hybrid.dense.layers)}/{len(hybrid.plan.hot)} blocks{output}, "
            f"{neurons}/{total} FFN neurons ({neurons / total:.0%})")


def run_accelerate(shape: tuple[int, ...], share: float, prompt: list[int], n_gen: int) -> Row:
    """transformers' llama in float16 with `share` of its weight bytes on GPU 0, the rest offloaded."""
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    n_layers, d, n_ff, n_head, vocab = shape
    started = time.perf_counter()
    config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=n_ff, num_hidden_layers=n_layers,
                         num_attention_heads=n_head, num_key_value_heads=n_head, hidden_act="relu",
                         max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.float16)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.uniform_(-0.02, 0.02)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    device_map = infer_auto_device_map(model, max_memory={0: int(share * weights), "cpu": 4 * weights},
                                       no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.float16)
    model = dispatch_model(model, device_map)
    load_s = time.perf_counter() - started
    on_gpu = sum(1 for where in device_map.values() if where == 0)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([prompt], device="cuda"), past_key_values=cache, use_cache=True)

        def step(token: int) -> torch.Tensor:
            logits = model(torch.tensor([[token]], device="cuda"), past_key_values=cache, use_cache=True).logits[0, -1]
            torch.cuda.synchronize()
            return logits

        speed, _ = decode_speed(step, int(out.logits[0, -1].argmax()), n_gen)
    return Row("accelerate (float16, device_map offload)", share * weights / 2**30,
               f"{on_gpu}/{len(device_map)} modules on the GPU, the rest copied over per token", load_s, speed)


# ---------------------------------------------------------------- the run


def write_results(rows: list[Row], args: argparse.Namespace, model_gib: float, output: Path) -> None:
    cpu = next((r.tokens_per_s for r in rows if r.name == "powerinfer CPU only"), None)
    base = next((r.tokens_per_s for r in rows if r.name.startswith("accelerate")), None)
    lines = [
        "# Hybrid CPU/GPU decoding under a VRAM budget",
        "",
        f"Measured {datetime.date.today()} on {machine_description()}; {torch.get_num_threads()} CPU threads.",
        f"Model: synthetic {args.shape} ReLU-llama (ReGLU), Q4_0 PowerInfer GGUF, {model_gib:.2f} GiB of weights, "
        f"predictors of rank {args.rank}; context {args.ctx}; prompt {args.prompt} tokens, then {args.tokens} greedy "
        "decode steps (median step time). Budgets are shares of the GGUF's weight bytes; accelerate gets the same "
        "share of its float16 weights.",
        "",
        "| engine | VRAM budget GiB | on the GPU | decode tok/s | vs accelerate | vs CPU only | FFN active | served on GPU | logits vs CPU only | load s |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        cell = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        vs_base = "" if base is None else f"{r.tokens_per_s / base:.1f}x"
        vs_cpu = "" if cpu is None else f"{r.tokens_per_s / cpu:.2f}x"
        lines.append(f"| {r.name} | {cell(r.budget_gib, '.2f')} | {r.placed} | {r.tokens_per_s:.2f} | {vs_base} | "
                     f"{vs_cpu} | {cell(r.active, '.1%')} | {cell(r.served, '.1%')} | {cell(r.logit_error, '.1e')} | "
                     f"{r.load_s:.0f} |")
    lines += ["", f"Command: `python benchmarks/hybrid_offload.py {' '.join(sys.argv[1:])}`", ""]
    output.write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="7b")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/powerinfer-hybrid"), help="where the model is written")
    parser.add_argument("--budgets", default="0.3", help="VRAM budgets as shares of the weights (comma-separated)")
    parser.add_argument("--accelerator", default="cuda")
    parser.add_argument("--rank", type=int, default=256, help="predictor rank")
    parser.add_argument("--firing-scale", type=float, default=0.2, help="scale of the firing law (0.2: ~10%% active)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("-t", "--threads", type=int, default=None)
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    path = args.workdir / f"relu-llama-{args.shape}.q4_0.powerinfer.gguf"
    if not path.exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        make_model(path, shape, args.rank, args.firing_scale)
    from powerinfer.gguf import open_gguf

    model_gib = sum(t.n_bytes for t in open_gguf(path).tensors.values()) / 2**30
    prompt = torch.randint(0, shape[4], (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    reference_row, reference = run_ours(path, prompt, args.tokens, args.ctx, None, args.accelerator)
    rows.append(reference_row)
    release()
    shares = [float(s) for s in args.budgets.split(",") if s]
    for share in shares:
        row, logits = run_ours(path, prompt, args.tokens, args.ctx, share * model_gib, args.accelerator)
        row.logit_error = float((logits - reference).abs().max() / reference.abs().max())
        rows.append(row)
        release()
        print(f"{row.name} {share:.0%}: {row.tokens_per_s:.2f} tok/s", file=sys.stderr)
    if not args.no_accelerate:
        rows.append(run_accelerate(shape, shares[0], prompt, max(4, args.tokens // 4)))
    write_results(rows, args, model_gib, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
