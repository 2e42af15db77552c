"""`powerinfer <command>`: argument parsing and error reporting; commands are imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from powerinfer.errors import PowerInferError


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag as one line on stderr and exits with status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_model_options(parser: argparse.ArgumentParser, ctx: bool = True) -> None:
    parser.add_argument("-m", "--model", help="GGUF or PowerInfer GGUF file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use)")
    parser.add_argument("-t", "--threads", type=positive_int, help="CPU threads (default: torch's choice, the physical cores)")
    if ctx:
        parser.add_argument("-c", "--ctx-size", type=positive_int, help="context size in tokens (default: min(4096, training context))")
    parser.add_argument("--dtype", choices=["auto", "float32"], default="auto",
                        help="auto: compact weights on fast kernels; float32: dequantize everything (exact, slow)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=40, help="top-k sampling; 0 = off (default: 40)")
    parser.add_argument("--top-p", type=float, default=0.95, help="top-p (nucleus) sampling; 1 = off (default: 0.95)")
    parser.add_argument("--min-p", type=float, default=0.05, help="min-p sampling; 0 = off (default: 0.05)")
    parser.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty; 1 = off (default: 1.0)")
    parser.add_argument("--repeat-last-n", type=int, default=64, help="tokens the repetition penalty looks back over (default: 64)")
    parser.add_argument("-s", "--seed", type=int, default=None, help="random seed (default: random)")


def sampling_from_args(args: argparse.Namespace) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="powerinfer", description="LLM inference on GGUF models with activation sparsity.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    run = commands.add_parser("run", help="generate text from a prompt")
    add_model_options(run)
    prompt = run.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="prompt text")
    prompt.add_argument("-f", "--file", help="read the prompt from this file")
    run.add_argument("-n", "--n-predict", type=int, default=-1, help="tokens to generate; -1 = until end of text or context (default: -1)")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_sampling_options(run)

    chat = commands.add_parser("chat", help="chat interactively using the model's chat template")
    add_model_options(chat)
    chat.add_argument("-sys", "--system", help="system message")
    chat.add_argument("-n", "--n-predict", type=int, default=-1, help="tokens per reply; -1 = until end of turn (default: -1)")
    add_sampling_options(chat)

    commands.add_parser("pull", help="download the default model into the cache folder")

    bench = commands.add_parser("bench", help="measure prompt processing and generation speed (llama-bench style)")
    add_model_options(bench, ctx=False)
    bench.add_argument("-p", "--n-prompt", type=positive_int, default=512, help="prompt tokens for the pp test (default: 512)")
    bench.add_argument("-n", "--n-gen", type=positive_int, default=128, help="tokens for the tg test (default: 128)")
    bench.add_argument("-r", "--repetitions", type=positive_int, default=5, help="repetitions of each test (default: 5)")
    ppl = commands.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    add_model_options(ppl)
    ppl.add_argument("-f", "--file", required=True, help="text file (e.g. wikitext-2 test.txt)")
    ppl.add_argument("--chunks", type=int, default=None, help="evaluate at most this many chunks (default: all)")
    profile = commands.add_parser("profile", help="count which FFN neurons fire over calibration text")
    add_model_options(profile, ctx=False)
    profile.add_argument("-f", "--file", required=True, help="calibration text (e.g. wikitext-2 valid.txt)")
    profile.add_argument("-o", "--output", required=True, help="output directory (gets activation/)")
    profile.add_argument("--tokens", type=positive_int, default=32768, help="calibration tokens (default: 32768)")
    profile.add_argument("--chunk", type=positive_int, default=512, help="tokens per forward pass (default: 512)")
    target = profile.add_mutually_exclusive_group()
    target.add_argument("--target-sparsity", type=unit_interval, help="SiLU/GELU models: fraction of neurons to skip")
    target.add_argument("--target-error", type=positive_float, help="SiLU/GELU models: max mean relative FFN error")

    inspect = commands.add_parser("inspect", help="plot activation statistics (the power-law figure)")
    inspect.add_argument("--activations", required=True, help="profile directory (with activation/)")
    inspect.add_argument("-o", "--output", required=True, help="image file (.png)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(f"powerinfer.commands.{args.command.replace('-', '_')}")
    try:
        return module.main(args) or 0
    except PowerInferError as error:
        print(f"powerinfer {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
