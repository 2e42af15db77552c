"""What constrained decoding (response_format json_schema) costs in decode speed.

One greedy run of the same chat prompt, free and held to a JSON schema, with the engine's own
decode loop (what the server's scheduler runs per step: decode, then mask and sample). Reports
decode tokens/s of each and the grammar's share of a step (mask computation, applying it, and
advancing the grammar), and writes benchmarks/results/constrained_decoding.md.

    python benchmarks/constrained_decoding.py [-m model.gguf] [-n 128] [-t 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from powerinfer import LLM
from powerinfer.runtime.constraint import Constraint, json_schema_grammar

from common import machine_description
from server_load import OtherLoad

PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to cook, as JSON."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "story", "characters"],
          "properties": {"title": {"type": "string"}, "story": {"type": "string"},
                         "characters": {"type": "array", "items": {"type": "string"}}}}
WARM_UP_TOKENS = 8


class TimedConstraint(Constraint):
    """A constraint that adds up the time its mask and grammar steps take."""

    seconds = 0.0

    def allowed(self):
        started = time.perf_counter()
        mask = super().allowed()
        self.seconds += time.perf_counter() - started
        return mask

    def advance(self, token: int) -> None:
        started = time.perf_counter()
        super().advance(token)
        self.seconds += time.perf_counter() - started


def run(llm: LLM, ids: list[int], max_tokens: int, constraint: Constraint | None) -> tuple[int, float, str]:
    """Greedy decode; returns (tokens decoded after the first, seconds of those steps, finish reason)."""
    engine = llm.new_engine(1)
    sequence = llm.new_sequence(ids, max_tokens, temperature=0, repeat_penalty=1.0, constraint=constraint)
    sequence.accept(engine.prefill(0, ids, reuse_prefix=False))
    started, steps = time.perf_counter(), 0
    while not sequence.finished:
        sequence.accept(engine.decode([(0, sequence.last_token)])[0])
        steps += 1
    return steps, time.perf_counter() - started, sequence.completion().finish_reason


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("-n", "--tokens", type=int, default=128, help="tokens to generate (default: 128)")
    parser.add_argument("-t", "--threads", type=int, default=None)
    parser.add_argument("-o", "--output", default=str(Path(__file__).parent / "results" / "constrained_decoding.md"))
    args = parser.parse_args()
    llm = LLM(args.model, n_ctx=1024, threads=args.threads)
    ids = llm.chat_prompt(PROMPT)
    grammar = json_schema_grammar(SCHEMA)
    run(llm, ids, WARM_UP_TOKENS, Constraint(llm.tokenizer, llm.config.n_vocab, grammar))  # kernels, vocabulary
    description = machine_description()  # its load average is taken before the runs
    load = OtherLoad()
    free_steps, free_seconds, free_end = run(llm, ids, args.tokens, None)
    constraint = TimedConstraint(llm.tokenizer, llm.config.n_vocab, grammar)
    json_steps, json_seconds, json_end = run(llm, ids, args.tokens, constraint)
    other = load.share()
    free_rate, json_rate = free_steps / free_seconds, json_steps / json_seconds
    rows = [
        "| run | decode steps | finish | decode tok/s | grammar ms/token |",
        "| --- | ---: | --- | ---: | ---: |",
        f"| free | {free_steps} | {free_end} | {free_rate:.1f} | - |",
        f"| json_schema | {json_steps} | {json_end} | {json_rate:.1f} | {constraint.seconds / (json_steps + 1) * 1e3:.3f} |",
    ]
    report = "\n".join([
        "# Constrained decoding cost", "",
        f"`python {' '.join(sys.argv)}`: {Path(llm.path).name}, greedy, one run "
        f"each after an {WARM_UP_TOKENS}-token warm-up, {torch.get_num_threads()} torch thread(s).", "",
        f"Machine: {description}; other processes used {other:.0%} of its CPU time during the runs.", "",
        *rows, "",
        f"Constrained decoding costs {1 - json_rate / free_rate:.1%} of decode tokens/s "
        f"(grammar share of a step: {constraint.seconds / json_seconds:.1%}).", ""])
    Path(args.output).write_text(report)
    print(report)


if __name__ == "__main__":
    main()
