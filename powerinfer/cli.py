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


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
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


def rank_list(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ranks or ranks[0] < 1:
        raise argparse.ArgumentTypeError(f"ranks must be >= 1, got {text!r}")
    return ranks


def add_model_options(parser: argparse.ArgumentParser, ctx: bool = True, sparsity: bool = True) -> None:
    parser.add_argument("-m", "--model", help="GGUF or PowerInfer GGUF file (default: SmolLM2-135M-Instruct Q4_1, fetched on first use)")
    parser.add_argument("-t", "--threads", type=positive_int, help="CPU threads (default: torch's choice, the physical cores)")
    if ctx:
        parser.add_argument("-c", "--ctx-size", type=positive_int, help="context size in tokens (default: min(4096, training context))")
    parser.add_argument("--dtype", choices=["auto", "float32"], default="auto",
                        help="auto: compact weights on fast kernels; float32: dequantize everything (exact, slow)")
    if sparsity:
        parser.add_argument("--sparsity", choices=["auto", "off", "oracle"], default="auto",
                            help="auto: compute only the FFN neurons the file's predictors expect to fire (dense without "
                                 "predictors); off: dense; oracle: skip exactly the neurons that do not fire (verification)")
        add_hybrid_options(parser)


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_hybrid_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vram-budget", type=non_negative_float, metavar="GB",
                        help="accelerator memory in GiB: dense parts (attention, output head) go there first, then the "
                             "hottest FFN neurons (default: CPU only)")
    parser.add_argument("--activations", metavar="DIR", help="activation statistics for placing neurons "
                        "(default: activation/ next to the model, else all neurons alike)")
    index = parser.add_mutually_exclusive_group()
    index.add_argument("--reset-gpu-index", action="store_true", help="rebuild <model>.generated.gpuidx")
    index.add_argument("--disable-gpu-index", action="store_true", help="no neuron split: ignore the GPU index, offload dense parts only")
    parser.add_argument("--accelerator", metavar="DEVICE",
                        help="torch device to offload to (default: cuda when present; cpu runs the split on the CPU)")


RAY_OPTIONS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "address", "num_cpus", "num_gpus")


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """`serve --ray`: the server's app as a Ray Serve deployment (options named in RAY_OPTIONS)."""
    group = parser.add_argument_group("Ray Serve", "replicas of this server behind Ray Serve's router "
                                                   "(needs the 'ray' extra: pip install 'powerinfer[ray]')")
    group.add_argument("--ray", action="store_true", help="serve through Ray Serve, one loaded model per replica")
    group.add_argument("--replicas", type=positive_int, metavar="N", help="a fixed number of replicas (default: 1)")
    group.add_argument("--min-replicas", type=non_negative_int, metavar="A", help="autoscaling: fewest replicas (default: 1)")
    group.add_argument("--max-replicas", type=positive_int, metavar="B", help="autoscaling: most replicas (default: A)")
    group.add_argument("--target-ongoing-requests", type=positive_float, metavar="T",
                       help="autoscaling: requests per replica to aim for (default: --parallel)")
    group.add_argument("--address", metavar="ADDR", help="join this Ray cluster (e.g. 10.0.0.1:6379, or 'auto'); "
                                                         "default: start a local one bound to 127.0.0.1")
    group.add_argument("--num-cpus", type=positive_float, metavar="C",
                       help="CPUs Ray reserves per replica; also its threads unless -t is given (default: 1)")
    group.add_argument("--num-gpus", type=non_negative_float, metavar="G",
                       help="GPUs per replica; each replica's --vram-budget is on its own GPU (default: 0)")


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


def add_calibration_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="calibration text (e.g. wikitext-2 valid.txt; never the test text)")
    parser.add_argument("--tokens", type=positive_int, default=32768, help="calibration tokens (default: 32768)")
    parser.add_argument("--chunk", type=positive_int, default=512, help="tokens per forward pass (default: 512)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target-sparsity", type=unit_interval, help="SiLU/GELU models: fraction of neurons to skip")
    target.add_argument("--target-error", type=positive_float, help="SiLU/GELU models: max mean relative FFN error")


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

    serve = commands.add_parser("serve", help="HTTP server: OpenAI-compatible and llama.cpp-style routes, continuous batching")
    add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8080, help="port (default: 8080; 0 = any free port)")
    serve.add_argument("-np", "--parallel", type=positive_int, default=4,
                       help="sequences decoded together (KV-cache slots); more requests wait in a queue (default: 4)")
    add_ray_options(serve)
    ppl = commands.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    add_model_options(ppl)
    ppl.add_argument("-f", "--file", required=True, help="text file (e.g. wikitext-2 test.txt)")
    ppl.add_argument("--chunks", type=int, default=None, help="evaluate at most this many chunks (default: all)")
    profile = commands.add_parser("profile", help="count which FFN neurons fire over calibration text")
    add_model_options(profile, ctx=False, sparsity=False)
    add_calibration_options(profile)
    profile.add_argument("-o", "--output", required=True, help="output directory (gets activation/)")

    train = commands.add_parser("train-predictors", help="train per-layer activation predictors (PowerInfer's format)")
    add_model_options(train, ctx=False, sparsity=False)
    add_calibration_options(train)
    train.add_argument("-o", "--output", required=True, help="predictor directory to write (model_{i}.pt, config.json)")
    train.add_argument("--recall", type=unit_interval, default=0.99, help="recall target per layer (default: 0.99)")
    train.add_argument("--ranks", type=rank_list, default=(32, 64, 128, 256, 512),
                       help="candidate predictor ranks, tried from the smallest up until a larger one gains under 2 points of sparsity (default: 32,64,128,256,512)")
    train.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps per fit (default: 1000)")

    convert = commands.add_parser("convert", help="Hugging Face folder or GGUF -> GGUF (PowerInfer GGUF with predictors)")
    convert.add_argument("source", help="Hugging Face checkpoint folder, GGUF or PowerInfer GGUF file")
    convert.add_argument("predictors", nargs="?", help="predictor directory (model_{i}.pt, config.json) -> PowerInfer GGUF")
    convert.add_argument("--outfile", required=True, help="output file")
    convert.add_argument("--outtype", help="f32, f16, q8_0, q4_0 or q4_1 (default: f16 from Hugging Face, "
                                           "the source's types from GGUF)")

    quantize = commands.add_parser("quantize", help="re-encode a (PowerInfer) GGUF's weights as Q4_0, Q4_1 or Q8_0")
    quantize.add_argument("input", help="GGUF or PowerInfer GGUF file")
    quantize.add_argument("output", help="output file")
    quantize.add_argument("type", help="Q4_0, Q4_1 or Q8_0")

    place = commands.add_parser("place", help="solve which FFN neurons go to the accelerator for a VRAM budget")
    place.add_argument("-m", "--model", required=True, help="GGUF or PowerInfer GGUF file")
    place.add_argument("--vram-budget", type=non_negative_float, required=True, metavar="GB", help="accelerator memory in GiB")
    place.add_argument("--activations", metavar="DIR", help="activation statistics (default: activation/ next to the model)")
    place.add_argument("-c", "--ctx-size", type=positive_int, help="context the KV cache is sized for (default: min(4096, training context))")
    place.add_argument("-o", "--write-index", nargs="?", const="", metavar="PATH",
                       help="write the GPU index (default path: <model>.generated.gpuidx); without it nothing is written")
    place.add_argument("--group-size", type=positive_int, default=64, help="neurons placed together (default: 64)")
    cpu = place.add_mutually_exclusive_group()
    cpu.add_argument("--cpu-bandwidth", type=positive_float, metavar="GB/s", help="CPU memory bandwidth (default: 24)")
    cpu.add_argument("--measure", action="store_true", help="measure this machine's CPU memory bandwidth instead")
    place.add_argument("--accelerator-bandwidth", type=positive_float, default=700.0, metavar="GB/s", help="default: 700")
    place.add_argument("--sync-us", type=non_negative_float, default=30.0, help="per-layer round trip in microseconds (default: 30)")

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
