"""`powerinfer run`: complete a prompt, text on stdout, timings on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from powerinfer.cli import sampling_from_args
from powerinfer.errors import PowerInferError
from powerinfer.runtime.sequence import Completion


def load_llm(args: argparse.Namespace):
    from powerinfer.llm import LLM

    return LLM(args.model, threads=args.threads, n_ctx=getattr(args, "ctx_size", None), dtype=args.dtype,
               sparsity=getattr(args, "sparsity", "off"), **hybrid_arguments(args))


def hybrid_arguments(args: argparse.Namespace) -> dict:
    """LLM keywords from the --vram-budget family of flags (absent on some commands)."""
    gpu_index = "reset" if getattr(args, "reset_gpu_index", False) else \
        "disable" if getattr(args, "disable_gpu_index", False) else "reuse"
    return dict(vram_budget=getattr(args, "vram_budget", None), n_gpu_layers=getattr(args, "n_gpu_layers", None),
                gpu_index=gpu_index, activations=getattr(args, "activations", None),
                accelerator=getattr(args, "accelerator", None), parallel=getattr(args, "parallel", 1))


def max_tokens(n_predict: int, llm) -> int:
    return llm.n_ctx if n_predict < 0 else n_predict


def print_timings(completion: Completion, load_seconds: float | None = None) -> None:
    t = completion.timings
    lines = []
    if load_seconds is not None:
        lines.append(f"load time        = {load_seconds * 1e3:10.2f} ms")
    lines.append(f"prompt eval time = {t.prompt_seconds * 1e3:10.2f} ms / {t.prompt_tokens:5d} tokens "
                 f"({t.prompt_seconds * 1e3 / max(t.prompt_tokens, 1):8.2f} ms per token, {t.prompt_tokens_per_second:8.2f} tokens per second)")
    lines.append(f"       eval time = {t.decode_seconds * 1e3:10.2f} ms / {t.decode_steps:5d} runs   "
                 f"({t.decode_seconds * 1e3 / max(t.decode_steps, 1):8.2f} ms per token, {t.decode_tokens_per_second:8.2f} tokens per second)")
    print("\n" + "\n".join(lines), file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    if args.file is not None:
        try:
            prompt = Path(args.file).read_text()
        except OSError as error:
            raise PowerInferError(f"cannot read prompt file: {error.strerror}: {args.file}") from None
    else:
        prompt = args.prompt
    llm = load_llm(args)
    stream = llm.generate_stream(prompt, max_tokens=max_tokens(args.n_predict, llm), stop=args.stop, **sampling_from_args(args))
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print_timings(stream.completion, llm.load_seconds)
    return 0
