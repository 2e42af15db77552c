"""Sparse decode side by side: the original PowerInfer's CPU build vs powerinfer, on one PowerInfer GGUF.

    git clone https://github.com/SJTU-IPADS/PowerInfer ~/src/PowerInfer
    .venv/bin/python benchmarks/powerinfer_original.py --powerinfer ~/src/PowerInfer --label "after compact K-quants"

PowerInfer is built from that tree, CPU only (`powerinfer_upstream.build`), and the file is made
by its own converter and quantizer (`powerinfer_upstream.make_model`: a 7B-width, 8-layer ReLU
llama, Q4_0 with a Q6_K output and Q4_0 predictors, ~10 % of neurons predicted active) unless
`--model` names one that exists.

Both engines run the same file, the same prompt tokens, greedy (EOS banned, as PowerInfer's
--ignore-eos; no repetition penalty), `--threads` threads, `--n-gen` tokens. PowerInfer's main
tokenizes the first word without SentencePiece's leading space ('Once' where llama's tokenizer and
ours give ' Once'), so ours is given the ids PowerInfer reports (--verbose-prompt).
- PowerInfer: its `main`, one process per repetition, as its README runs it (the file memory-mapped);
  decode speed from its own "eval time" line (the single-token steps after the prompt, which it
  counts as runs); its peak RSS from GNU time;
- powerinfer: `LLM(..., sparsity="auto")` loaded once in this process; the same single-token
  `Engine.decode` steps after the prompt, timed.
Repetitions interleave (the machine is shared), one warm-up each; medians are reported, and "vs
PowerInfer" is the median of each repetition's ratio to its PowerInfer run.

`--mode dense` runs every FFN neuron: powerinfer with `sparsity="off"` (its dense QuantLinear FFN,
no predictors), PowerInfer on the same file with LLAMA_SPARSE_PRED_THRESHOLD=-1e30, so that its
predictors (which still run) select every neuron of its sparse operators: it reads no dense file.

`--isa avx2` compares the two on AVX2 on any x86-64 machine: ours forced to AVX2 (POWERINFER_ISA),
PowerInfer built without AVX-512 (`powerinfer_upstream.cmake_flags`, in `<powerinfer>/build-avx2`).
Each row of the table names the instruction set its engine ran: ours as its kernels report it,
PowerInfer's from the system_info line its main prints.

Bytes read per token: the weights each engine reads for one token, by part. powerinfer's from the
loaded model (its storage, which is not the file's where it expands a type) and the neurons its
predictors chose (per layer, averaged over the tokens); PowerInfer's from the file's tensors (ggml
computes on the file's types), with the same share of neurons: both run the same Q4_0 predictors.
Norms and the embedding row (< 0.1 MB) are left out. The FFN row counts whole neuron records (gate,
up, down); powerinfer reads the up and down rows only of the chosen neurons whose gate is positive
(about half of them with this file's random weights), so it reads less there than the table says.

Results: benchmarks/results/powerinfer_original.md, one section per `--label` (a re-run with the
same label replaces its section).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import powerinfer_upstream as upstream
import torch

from common import ROOT, interleaved, isa_environment, machine_description, paired_ratio

RESULTS = ROOT / "benchmarks" / "results" / "powerinfer_original.md"
DEFAULT_MODEL = Path.home() / ".cache" / "powerinfer" / "bench" / "relu-7bw-8l.q4_0.powerinfer.gguf"
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"
TITLE = "# Sparse decode: the original PowerInfer vs powerinfer"
PARTS = ("attention", "predictors (fc1, fc2)", "FFN neurons (active share)", "output")
EVAL_LINE = re.compile(r"^llama_print_timings:\s+eval time =\s*([\d.]+) ms /\s*(\d+) runs", re.M)
GNU_TIME = "/usr/bin/time"  # apt-get install time
PROMPT_TOKEN_LINE = re.compile(r"^\s*(\d+) -> '", re.M)  # --verbose-prompt: "  9038 -> ' Once'"
SYSTEM_INFO_LINE = re.compile(r"^system_info: .*$", re.M)  # "... | AVX2 = 1 | AVX512 = 0 | ..."
EVERY_NEURON = "-1e30"  # LLAMA_SPARSE_PRED_THRESHOLD of PowerInfer's dense runs: every score passes it


@dataclass
class Runs:
    """Decode timings of one engine: (seconds, steps) per repetition, and its peak RSS."""

    timings: list[tuple[float, int]] = field(default_factory=list)
    peak_rss: int = 0
    isa: str = "?"

    def rates(self) -> list[float]:
        return [steps / seconds for seconds, steps in self.timings]

    @property
    def median(self) -> float:
        return statistics.median(self.rates())


# ---------------------------------------------------------------- the original PowerInfer

def powerinfer_isa(system_info: str) -> str:
    """The widest x86 instruction set a PowerInfer build computes with, from its system_info line."""
    flags = {name.strip(): value.strip() == "1" for name, _, value in
             (part.partition("=") for part in system_info.split("|")[1:]) if value}
    return "avx512" if flags.get("AVX512") else "avx2" if flags.get("AVX2") else "scalar"


def powerinfer_run(main: Path, model: Path, prompt: str, n_gen: int, threads: int, n_ctx: int,
                   dense: bool) -> tuple[float, int, list[int], int, str]:
    """One `main` run: (decode seconds, decode steps, its prompt's token ids, peak RSS bytes, ISA);
    `dense`: every neuron computed (EVERY_NEURON).

    Its peak RSS comes from GNU time: a child forked from this process would report this
    process's peak as well (Linux carries the high-water mark over fork and exec)."""
    command = [str(main), "-m", str(model), "-p", prompt, "-n", str(n_gen), "-t", str(threads), "-tb", str(threads),
               "-c", str(n_ctx), "--temp", "0", "--repeat-penalty", "1.0", "--ignore-eos", "--seed", "0", "--verbose-prompt"]
    env = {**os.environ, "LLAMA_SPARSE_PRED_THRESHOLD": EVERY_NEURON} if dense else None
    with tempfile.TemporaryDirectory() as scratch:  # its working folder: main writes main.log there
        rss = Path(scratch) / "peak-rss"
        result = subprocess.run([GNU_TIME, "-f", "%M", "-o", str(rss), *command], cwd=scratch, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak_kib = rss.read_text().split()[-1] if rss.exists() else "0"
    found, prompt_ids = EVAL_LINE.search(result.stderr), [int(i) for i in PROMPT_TOKEN_LINE.findall(result.stderr)]
    system_info = SYSTEM_INFO_LINE.search(result.stderr)
    if result.returncode != 0 or found is None or not prompt_ids or system_info is None:
        sys.exit(f"PowerInfer's main failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return (float(found.group(1)) / 1e3, int(found.group(2)), prompt_ids, int(peak_kib) * 1024,
            powerinfer_isa(system_info.group(0)))


def file_bytes_per_token(model: Path, active: float) -> dict[str, float]:
    """PowerInfer's bytes per token, by part: the file's tensors, FFN neurons at the `active` share."""
    from powerinfer.gguf.reader import open_gguf

    parts: Counter = Counter()
    for tensor in open_gguf(model).tensors.values():
        kind = tensor.name.split(".")[-2]
        if kind.startswith("attn_") and kind != "attn_norm":
            parts["attention"] += int(tensor.n_bytes)
        elif kind in ("fc1", "fc2"):
            parts["predictors (fc1, fc2)"] += int(tensor.n_bytes)
        elif kind in ("ffn_gate", "ffn_up", "ffn_down_t"):
            parts["FFN neurons (active share)"] += int(tensor.n_bytes) * active
        elif tensor.name == "output.weight":
            parts["output"] += int(tensor.n_bytes)
    return dict(parts)


# ---------------------------------------------------------------- ours

class Ours:
    """powerinfer with the file's predictors (or, `dense`, every neuron), loaded once."""

    def __init__(self, model: Path, threads: int, n_ctx: int, dense: bool):
        from powerinfer import LLM
        from powerinfer.ops import native

        started = time.perf_counter()
        self.llm = LLM(model, threads=threads, n_ctx=n_ctx, sparsity="off" if dense else "auto")
        self.load_seconds = time.perf_counter() - started
        self.dense = dense
        self.isa = native.kernels_label() if native.load() is not None else "torch"
        self.blocks = self.llm.model.blocks
        self.active: list[list[float]] = []  # per decode step, per layer: the share of neurons computed

    def greedy(self, logits: torch.Tensor) -> int:
        logits = logits.clone()
        logits[self.llm.tokenizer.eos_id] = float("-inf")
        return int(logits.argmax())

    def run(self, prompt_ids: list[int], n_gen: int) -> tuple[float, int]:
        """(decode seconds, decode steps): the prompt, then n_gen - 1 greedy single-token steps."""
        engine = self.llm.engine
        engine.release(0)
        token = self.greedy(engine.prefill(0, prompt_ids))
        steps: list[list[int]] = []
        started = time.perf_counter()
        for _ in range(n_gen - 1):
            token = self.greedy(engine.decode([(0, token)])[0])
            steps.append([1.0 if self.dense else block.ffn.last_active / block.ffn.store.n_ff for block in self.blocks])
        seconds = time.perf_counter() - started
        self.active += steps
        return seconds, len(steps)

    def active_share(self) -> float:
        return statistics.fmean(statistics.fmean(step) for step in self.active)

    def bytes_per_token(self) -> dict[str, float]:
        """From the loaded model: what it stores, FFN records at each layer's measured share."""
        per_layer = [statistics.fmean(step[i] for step in self.active) for i in range(len(self.blocks))]
        ffn_bytes = [b.ffn.nbytes if self.dense else b.ffn.store.nbytes for b in self.blocks]
        return {"attention": sum(b.attention.nbytes for b in self.blocks),
                "predictors (fc1, fc2)": 0 if self.dense else sum(b.ffn.selector.nbytes for b in self.blocks),
                "FFN neurons (active share)": sum(share * n for share, n in zip(per_layer, ffn_bytes)),
                "output": self.llm.model.output.nbytes}


# ---------------------------------------------------------------- report

def section(args, machine: str, prompt_ids: list[int], original: Runs, ours: Ours, our_runs: Runs,
            load_after: str) -> str:
    theirs_bytes = file_bytes_per_token(args.model, ours.active_share())
    our_bytes = ours.bytes_per_token()
    total = lambda parts: sum(parts.values()) / 1e6  # noqa: E731
    theirs_name = ("PowerInfer (original, CPU build, every neuron)" if args.mode == "dense"
                   else "PowerInfer (original, CPU build)")
    rows = [(theirs_name, original, total(theirs_bytes)),
            (f'powerinfer (`sparsity="{"off" if args.mode == "dense" else "auto"}"`)', our_runs, total(our_bytes))]
    table = ["| engine | ISA | decode tok/s (median) | min – max | vs PowerInfer | bytes read per token (MB) | implied GB/s | peak RSS (MiB) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, runs, mb in rows:
        rates = runs.rates()
        table.append(f"| {name} | {runs.isa} | {runs.median:.2f} | {min(rates):.2f} – {max(rates):.2f} | "
                     f"{paired_ratio(rates, original.rates())[0]:.2f}x | {mb:.0f} | {runs.median * mb / 1e3:.1f} | "
                     f"{runs.peak_rss / 2**20:.0f} |")
    parts = ["| part | PowerInfer (MB) | powerinfer (MB) |", "| --- | ---: | ---: |"]
    parts += [f"| {part} | {theirs_bytes.get(part, 0) / 1e6:.1f} | {our_bytes[part] / 1e6:.1f} |" for part in PARTS]
    parts.append(f"| total | {total(theirs_bytes):.1f} | {total(our_bytes):.1f} |")
    commit = args.powerinfer_commit or upstream.commit(args.powerinfer) or "unknown (pass --powerinfer-commit)"
    options = (f" --isa {args.isa}" if args.isa else "") + (f" --mode {args.mode}" if args.mode != "sparse" else "")
    dense_note = (f"Dense: every FFN neuron; PowerInfer with LLAMA_SPARSE_PRED_THRESHOLD={EVERY_NEURON} (its predictors still "
                  'run and select every neuron), powerinfer with `sparsity="off"` ' if args.mode == "dense" else "")
    types = ", ".join(f"{kind} {type_name}" for (kind, type_name), _ in sorted(upstream.tensor_types(args.model).items())
                      if not kind.endswith("norm.weight"))
    command = (f".venv/bin/python benchmarks/powerinfer_original.py --powerinfer PATH --label \"{args.label}\" "
               f"--threads {args.threads} --n-gen {args.n_gen} --reps {args.reps}{options}")
    return "\n".join([
        f"## {args.label}",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine}; load average {load_after} at the end.",
        f"PowerInfer: commit `{commit}` (https://github.com/SJTU-IPADS/PowerInfer), its `main`, built CPU-only with",
        f"CMake `{' '.join(upstream.cmake_flags(args.isa))}`"
        f"{'; powerinfer forced to plain AVX2 (POWERINFER_ISA=avx2, POWERINFER_AVX_VNNI=0)' if args.isa == 'avx2' else ''}.",
        f"File: `{args.model.name}` ({args.model.stat().st_size / 2**20:.0f} MiB), made by PowerInfer's convert.py and",
        f"`quantize ... Q4_0`: {types}.",
        f"{args.threads} thread{'s' if args.threads > 1 else ''}; prompt \"{args.prompt}\" ({len(prompt_ids)} tokens, as "
        f"PowerInfer's main tokenized it, fed to both); {args.n_gen} greedy tokens, i.e. {args.n_gen - 1} "
        f"single-token decode steps per run; medians of {args.reps} interleaved repetitions after one warm-up each; "
        "vs PowerInfer: the median of each repetition's ratio to its PowerInfer run.",
        (dense_note or f"powerinfer's predictors chose {ours.active_share():.1%} of the FFN neurons per token on average ")
        + f"(load time {ours.load_seconds:.0f} s).",
        "",
        *table,
        "",
        "Bytes read per token, by part:",
        "",
        *parts,
        "",
        f"Command: `{command}`",
        "",
    ])


def write_results(out: Path, new_section: str, label: str) -> None:
    """Keep the other labels' sections; this label's section is replaced where it stands, or added last."""
    sections = [f"## {chunk.rstrip()}\n" for chunk in out.read_text().split("\n## ")[1:]] if out.exists() else []
    ours = [i for i, text in enumerate(sections) if text.startswith(f"## {label}\n")]
    if ours:
        sections[ours[0]] = new_section
    else:
        sections.append(new_section)
    intro = (f"{TITLE}\n\nWritten by `benchmarks/powerinfer_original.py` (how it measures: its docstring; PATH below is a "
             "clone of https://github.com/SJTU-IPADS/PowerInfer at the commit named). The issue-13 target: powerinfer's "
             "sparse decode >= 1.3x PowerInfer's on this file, 2 threads. Timings from a loaded machine (see each "
             "section's load average; 2 cores) say little: compare runs made when the load is near 0.\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([intro, *sections]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--powerinfer", type=Path, required=True,
                        help="PowerInfer source tree (git clone https://github.com/SJTU-IPADS/PowerInfer); built if needed")
    parser.add_argument("--powerinfer-commit", help="the tree's commit, where it is not a git checkout")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="PowerInfer GGUF (made here if absent)")
    parser.add_argument("--label", required=True, help="names this run's section of the results, e.g. 'before compact K-quants'")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--isa", choices=upstream.ISAS,
                        help="both engines on this instruction set only (default: the best each finds on this CPU)")
    parser.add_argument("--mode", choices=("sparse", "dense"), default="sparse",
                        help="dense: every FFN neuron, in both engines (see the docstring)")
    args = parser.parse_args()
    args.powerinfer, args.model = args.powerinfer.resolve(), args.model.resolve()

    if not Path(GNU_TIME).exists():
        sys.exit(f"{GNU_TIME} (GNU time) is needed for PowerInfer's peak RSS: apt-get install time")
    if args.isa:  # before our kernels first run: the switch is read once per process
        os.environ.update(isa_environment(args.isa))
    machine = machine_description()  # load average before anything of ours runs
    upstream.build(args.powerinfer, args.isa)
    if not args.model.exists():  # in a process of its own: this one's peak RSS is powerinfer's
        subprocess.run([sys.executable, upstream.__file__, "--powerinfer", str(args.powerinfer), "--out", str(args.model),
                        *(["--isa", args.isa] if args.isa else [])], check=True)
    main_binary = upstream.binary(args.powerinfer, "main", args.isa)
    dense = args.mode == "dense"
    ours = Ours(args.model, args.threads, args.n_ctx, dense)
    if args.isa and ours.isa != args.isa:
        sys.exit(f"powerinfer runs {ours.isa}, not {args.isa}: this CPU lacks it, or the native operators are not built")
    original, our_runs = Runs(), Runs()
    prompt_ids: list[int] = []  # as PowerInfer's main tokenizes the prompt: ours then runs the same ids
    for rep in range(args.reps + 1):
        # alternate who goes first, so that a change in the machine's load hits both alike
        for engine in interleaved(["powerinfer", "ours"], rep):
            if engine == "powerinfer":
                seconds, steps, prompt_ids, rss, original.isa = powerinfer_run(main_binary, args.model, args.prompt,
                                                                                 args.n_gen, args.threads, args.n_ctx, dense)
                original.peak_rss = max(original.peak_rss, rss)
                if rep:
                    original.timings.append((seconds, steps))
            else:
                seconds, steps = ours.run(prompt_ids, args.n_gen)
                if rep:
                    our_runs.timings.append((seconds, steps))
        print(f"repetition {rep}/{args.reps}{' (warm-up)' if rep == 0 else ''}: PowerInfer "
              f"{original.rates()[-1] if rep else float('nan'):.2f} tok/s, powerinfer "
              f"{our_runs.rates()[-1] if rep else float('nan'):.2f} tok/s", file=sys.stderr)
    our_runs.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    our_runs.isa = ours.isa
    load_after = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    text = section(args, machine, prompt_ids, original, ours, our_runs, load_after)
    print(text)
    write_results(args.out, text, args.label)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
