"""`powerinfer <command>`: argument parsing and error reporting; commands are imported lazily."""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
from collections.abc import Callable, Sequence

from powerinfer.commands.llama_flags import add_model_flags, add_server_flags, note_flags_without_effect
from powerinfer.errors import PowerInferError
from powerinfer.options import CACHE_TYPE_NAMES, DTYPES, SPARSITY_MODES

# Several letters behind one dash, as llama.cpp spells -ngl, -cnv, -sys, -hf. argparse would read an
# unknown one as a short flag with its value glued on (-ngl 99 as -n gl), so they are refused
# unless the command defines them whole. A glued number (-n128, -t2) stays allowed.
MULTI_LETTER_FLAG = re.compile(r"-[A-Za-z][A-Za-z_-]+")


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag as one line on stderr and exits with status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._refuse_split_flags(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _refuse_split_flags(self, args: Sequence[str]) -> None:
        has_commands = self._subparsers is not None
        for arg in args:
            if arg == "--" or (has_commands and not arg.startswith("-")):
                return  # the rest belongs to the command's parser
            if MULTI_LETTER_FLAG.fullmatch(arg) and arg not in self._option_string_actions:
                self.error(f"unknown flag {arg} (single-dash flags are read whole, never as {arg[:2]} "
                           f"with the value {arg[2:]!r}; write '{arg[:2]} VALUE' with a space for that)")


class VersionAction(argparse.Action):
    """--version: the build, computed only when asked (it imports torch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from powerinfer.build_info import build_lines

        print("\n".join(build_lines()))
        parser.exit(0)


def number(kind: type, low: float | None = None, high: float | None = None, *, above: bool = False,
           below: bool = False) -> Callable[[str], int | float]:
    """An argparse type: `kind(text)` within [low, high] (`above`/`below`: open at that end)."""
    low_text = "" if low is None else f"{'(' if above else '['}{low:g}"
    high_text = "" if high is None else f"{high:g}{')' if below else ']'}"
    if low is not None and high is not None:
        wanted = f"in {low_text}, {high_text}"
    elif low is not None:
        wanted = f"{'>' if above else '>='} {low:g}"
    else:
        wanted = f"{'<' if below else '<='} {high:g}"

    def parse(text: str):
        value = kind(text)  # a ValueError becomes argparse's "invalid <kind> value"
        if not math.isfinite(value) or abs(value) >= 2**63:  # NaN passes every comparison below
            raise argparse.ArgumentTypeError(f"must be a finite number below 2^63, got {text}")
        ok = (low is None or (value > low if above else value >= low)) and \
             (high is None or (value < high if below else value <= high))
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


positive_int = number(int, 1)
non_negative_int = number(int, 0)
positive_float = number(float, 0, above=True)
non_negative_float = number(float, 0)
unit_interval = number(float, 0, 1, below=True)


MAX_THREADS = 4096  # torch refuses more than a C int, and no machine has more cores


def is_utf8(text: str) -> bool:
    """Whether `text` came from valid UTF-8: undecodable bytes of argv or stdin reach Python as lone
    surrogates (PEP 383), which the tokenizer cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_text(text: str) -> str:
    """An argparse type for text flags (see `is_utf8`)."""
    if not is_utf8(text):
        raise argparse.ArgumentTypeError("is not valid UTF-8 text")
    return text


utf8_text.__name__ = "text"


# llama-bench's range forms inside a list: first-last, first-last+step, first-last*factor.
INT_RANGE = re.compile(r"(?P<first>\d+)-(?P<last>\d+)(?:(?P<op>[+*])(?P<step>\d+))?")


def int_list(item: Callable[[str], int]) -> Callable[[str], list[int]]:
    """An argparse type for llama-bench's lists: `-p 128,512`, `-t 1-4`, `-p 64-512*2`, `-n 1-9+4`."""

    def expand(part: str) -> list[int]:
        found = INT_RANGE.fullmatch(part)
        if found is None:
            return [item(part)]
        first, last, op, step = int(found["first"]), int(found["last"]), found["op"] or "+", int(found["step"] or 1)
        if last < first or step < (2 if op == "*" else 1) or first == 0 and op == "*":
            raise argparse.ArgumentTypeError(f"bad range {part!r}")
        values = [first]
        while (values[-1] * step if op == "*" else values[-1] + step) <= last:
            values.append(values[-1] * step if op == "*" else values[-1] + step)
        return [item(str(v)) for v in values]

    def parse(text: str) -> list[int]:
        return [value for part in text.split(",") for value in expand(part)]

    parse.__name__ = "comma-separated list"
    return parse


def rank_list(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ranks or ranks[0] < 1:
        raise argparse.ArgumentTypeError(f"ranks must be >= 1, got {text!r}")
    return ranks


def add_model_source(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """-m PATH or REPO, -hf REPO[:QUANT], --hf-file FILE."""
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("-m", "--model", help="GGUF or PowerInfer GGUF file, or a Hugging Face repo ORG/NAME[:QUANT] "
                        "(default: SmolLM2-135M-Instruct Q4_1, fetched on first use)")
    source.add_argument("-hf", "-hfr", "--hf-repo", metavar="ORG/NAME[:QUANT]",
                        help="Hugging Face repo, through the local Hugging Face cache (works offline once cached); "
                             "QUANT picks the .gguf whose name contains it (default Q4_K_M, else the only .gguf)")
    parser.add_argument("-hff", "--hf-file", metavar="FILE", help="file in the Hugging Face repo (overrides :QUANT)")


def add_model_options(parser: argparse.ArgumentParser, ctx: bool = True, sparsity: bool = True,
                      thread_lists: bool = False) -> None:
    add_model_source(parser)
    if thread_lists:  # bench: one run of the tests per count, as llama-bench's -t 1,2
        parser.add_argument("-t", "--threads", type=int_list(number(int, 1, MAX_THREADS)), action="extend", metavar="N[,N...]",
                            help="CPU thread counts to measure with (default: torch's choice, the physical cores)")
    else:
        parser.add_argument("-t", "--threads", type=number(int, 1, MAX_THREADS), help="CPU threads (default: torch's choice, the physical cores)")
    if ctx:
        parser.add_argument("-c", "--ctx-size", type=positive_int, help="context size in tokens (default: min(4096, training context))")
    parser.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=non_negative_int, metavar="N",
                        help="layers to offload to the GPU, as in llama.cpp (without a CUDA device: everything runs on the CPU)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto: compact weights on fast kernels; float32: dequantize everything (exact, slow)")
    parser.add_argument("-ctk", "--cache-type", choices=CACHE_TYPE_NAMES,
                        help="KV cache type in CPU memory (default: f16, as llama.cpp; f32 with --dtype float32)")
    add_model_flags(parser)
    if sparsity:
        parser.add_argument("--sparsity", choices=SPARSITY_MODES, default="auto",
                            help="auto: compute only the FFN neurons the file's predictors expect to fire (dense without "
                                 "predictors); off: dense; oracle: skip exactly the neurons that do not fire (verification)")
        add_hybrid_options(parser)


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
                                                         "default: start a local one on 127.0.0.1")
    group.add_argument("--num-cpus", type=positive_float, metavar="C",
                       help="CPUs Ray reserves per replica; also its threads unless -t is given (default: 1)")
    group.add_argument("--num-gpus", type=non_negative_float, metavar="G",
                       help="GPUs per replica; each replica's --vram-budget is on its own GPU (default: 0)")


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """`serve`'s limits on clients (docs/serving.md, "Limits and timeouts")."""
    group = parser.add_argument_group("limits", "what one client may take of the server")
    group.add_argument("--read-timeout", type=number(float, 0, 3600, above=True), default=30.0, metavar="SECONDS",
                       help="a request's headers, then its body, must each arrive within this long; slower ones "
                            "get 408 and are closed (default: 30)")
    group.add_argument("--keep-alive", type=number(float, 0, 3600, above=True), default=5.0, metavar="SECONDS",
                       help="an idle kept-alive connection is closed after this long (default: 5)")
    group.add_argument("--max-connections", type=number(int, 1, 1_000_000), default=256, metavar="N",
                       help="beyond this many connections or requests in progress, requests get 503 (default: 256)")
    group.add_argument("--max-body-memory", type=number(int, 1, 2**40), default=64 * 1024 * 1024, metavar="BYTES",
                       help="bytes of all the request bodies being read at once; a body that would pass it gets 503 "
                            "(default: 64 MiB)")
    group.add_argument("--max-embedding-tokens", type=number(int, 1, 2**31), default=32768, metavar="N",
                       help="tokens one /v1/embeddings request may ask for, its inputs together; more get 400 "
                            "(default: 32768)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling flags, range-checked here so that a bad value stops before the model loads."""
    parser.add_argument("--temp", type=non_negative_float, default=0.8, help="temperature; 0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=non_negative_int, default=40, help="top-k sampling; 0 = off (default: 40)")
    parser.add_argument("--top-p", type=number(float, 0, 1, above=True), default=0.95,
                        help="top-p (nucleus) sampling; 1 = off (default: 0.95)")
    parser.add_argument("--min-p", type=number(float, 0, 1), default=0.05, help="min-p sampling; 0 = off (default: 0.05)")
    parser.add_argument("--repeat-penalty", type=positive_float, default=1.0, help="repetition penalty; 1 = off (default: 1.0)")
    parser.add_argument("--repeat-last-n", type=non_negative_int, default=64,
                        help="tokens the repetition penalty looks back over (default: 64)")
    parser.add_argument("-s", "--seed", type=number(int, -1), default=-1, help="random seed; -1 = random (default: -1)")


def sampling_from_args(args: argparse.Namespace) -> dict:
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                seed=None if args.seed == -1 else args.seed)


def add_generation_options(parser: argparse.ArgumentParser, chat: bool) -> None:
    """What run and chat share: a model, a prompt, a system prompt, a length, stop strings, sampling."""
    add_model_options(parser)
    prompt = parser.add_mutually_exclusive_group()
    first = "the first user message" if chat else "prompt text (with -cnv: the first user message)"
    prompt.add_argument("-p", "--prompt", type=utf8_text, help=first)
    prompt.add_argument("-f", "--file", help=f"read {'the first user message' if chat else 'the prompt'} from this file")
    parser.add_argument("-sys", "--system-prompt", "--system", dest="system", type=utf8_text,
                        help="system message" + ("" if chat else " (with -cnv)"))
    parser.add_argument("-n", "--n-predict", type=number(int, -1), default=-1,
                        help=f"tokens {'per reply' if chat else 'to generate'}; -1 = until the end of "
                             f"{'the turn' if chat else 'text'} or the context (default: -1)")
    parser.add_argument("--stop", action="append", default=[], type=utf8_text, help="stop string (repeatable)")
    add_chat_template_options(parser)
    add_sampling_options(parser)


def add_chat_template_options(parser: argparse.ArgumentParser) -> None:
    """--chat-template NAME|FILE, and llama.cpp's --jinja (our templates are always Jinja)."""
    from powerinfer.chat_formats import BUILT_IN, chosen_template

    def template_spec(text: str) -> str:
        try:
            chosen_template(text)  # refused here, before any model loads
        except PowerInferError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    template_spec.__name__ = "chat template"
    parser.add_argument("--chat-template", type=template_spec, metavar="NAME|FILE",
                        help=f"chat template instead of the file's: a built-in ({', '.join(BUILT_IN)}) or a Jinja file "
                             "(default: the file's; without one, a built-in chosen by architecture and tokens)")
    parser.add_argument("--jinja", action="store_true", help="accepted for llama.cpp habits: templates are always Jinja here")


def add_calibration_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--file", required=True, help="calibration text (e.g. wikitext-2 valid.txt; never the test text)")
    parser.add_argument("--tokens", type=positive_int, default=32768, help="calibration tokens (default: 32768)")
    parser.add_argument("--chunk", type=positive_int, default=512, help="tokens per forward pass (default: 512)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--target-sparsity", type=unit_interval,
                        help="SiLU/GELU models: fraction of neurons to skip (default: 0.5 unless --target-error is given)")
    target.add_argument("--target-error", type=positive_float, help="SiLU/GELU models: max mean relative FFN error")


def add_force_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output (in a folder, only the files this command writes)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="powerinfer", description="LLM inference on GGUF models with activation sparsity.")
    parser.add_argument("--version", action=VersionAction, nargs=0,
                        help="print the version, commit, native instruction set, torch version and CUDA, and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    run = commands.add_parser("run", help="generate text from a prompt")
    add_generation_options(run, chat=False)
    conversation = run.add_mutually_exclusive_group()
    conversation.add_argument("-cnv", "--conversation", action="store_true", help="chat instead (the chat command)")
    conversation.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_false",
                              help="complete the prompt (the default)")

    chat = commands.add_parser("chat", help="chat interactively using the model's chat template")
    add_generation_options(chat, chat=True)
    chat.add_argument("-cnv", "--conversation", action="store_true", default=True, help="accepted for llama.cpp habits: chat always converses")

    pull = commands.add_parser("pull", help="download a model: the default one, or a Hugging Face repo's GGUF into the HF cache")
    pull.add_argument("repo", nargs="?", metavar="ORG/NAME[:QUANT]", help="Hugging Face repo (default: the default model)")
    pull.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", metavar="ORG/NAME[:QUANT]", help="same as the positional repo")
    pull.add_argument("-hff", "--hf-file", metavar="FILE", help="file in the repo (overrides :QUANT)")

    show = commands.add_parser("show", help="what a model file holds: architecture, parameters, quantization, "
                                            "tokenizer, chat template, sparsity (no weights loaded)")
    show.add_argument("model", nargs="?", metavar="MODEL", help="file or Hugging Face repo ORG/NAME[:QUANT] "
                                                                "(default: the default model)")
    show.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", metavar="ORG/NAME[:QUANT]", help="Hugging Face repo")
    show.add_argument("-hff", "--hf-file", metavar="FILE", help="file in the repo (overrides :QUANT)")
    show.add_argument("--json", action="store_true", help="print JSON")

    bench = commands.add_parser("bench", help="measure prompt processing and generation speed (llama-bench style)")
    add_model_options(bench, ctx=False, thread_lists=True)
    bench.add_argument("-p", "--n-prompt", type=int_list(non_negative_int), action="extend", metavar="N[,N...]",
                       help="prompt lengths for the pp tests (lists, ranges A-B, A-B+STEP, A-B*FACTOR); 0 = none "
                            "(default: 512)")
    bench.add_argument("-n", "--n-gen", type=int_list(non_negative_int), action="extend", metavar="N[,N...]",
                       help="generation lengths for the tg tests; 0 = none (default: 128)")
    bench.add_argument("-r", "--repetitions", type=positive_int, default=5, help="repetitions of each test (default: 5)")
    bench.add_argument("-o", "--output", choices=["md", "csv", "json", "jsonl"], default="md",
                       help="output format on stdout, with llama-bench's field names (default: md)")

    serve = commands.add_parser("serve", help="HTTP server: OpenAI-compatible and llama.cpp-style routes, continuous batching")
    add_model_options(serve)
    add_chat_template_options(serve)
    add_server_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=number(int, 0, 65535), default=8080, help="port (default: 8080; 0 = any free port)")
    serve.add_argument("-np", "--parallel", type=positive_int, default=4,
                       help="sequences decoded together (KV-cache slots); more requests wait in a queue (default: 4)")
    serve.add_argument("--max-body-size", type=positive_int, default=8 * 1024 * 1024, metavar="BYTES",
                       help="largest request body accepted; larger ones get 413 (default: 8 MiB)")
    serve.add_argument("--allowed-hosts", metavar="NAMES",
                       help="comma-separated names the Host header may carry, '*' for any "
                            "(default: loopback names when --host is a loopback address, else any)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (repeat for several keys)")
    serve.add_argument("--api-key-file", metavar="FILE", help="file of API keys, one a line")
    serve.add_argument("--watchdog", type=positive_float, default=120.0, metavar="SECONDS",
                       help="/health answers 503 when queued work has waited this long for a scheduler step (default: 120)")
    add_ray_options(serve)
    add_limit_options(serve)
    ppl = commands.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    add_model_options(ppl)
    ppl.add_argument("-f", "--file", required=True, help="text file (e.g. wikitext-2 test.txt)")
    ppl.add_argument("--chunks", type=positive_int, default=None, help="evaluate at most this many chunks (default: all)")
    profile = commands.add_parser("profile", help="count which FFN neurons fire over calibration text")
    add_model_options(profile, ctx=False, sparsity=False)
    add_calibration_options(profile)
    profile.add_argument("-o", "--output", required=True, help="output directory (gets activation/)")
    add_force_option(profile)

    train = commands.add_parser("train-predictors", help="train per-layer activation predictors (PowerInfer's format)")
    add_model_options(train, ctx=False, sparsity=False)
    add_calibration_options(train)
    train.add_argument("-o", "--output", required=True, help="predictor directory to write (model_{i}.pt, config.json)")
    train.add_argument("--recall", type=unit_interval, default=0.99, help="recall target per layer (default: 0.99)")
    train.add_argument("--ranks", type=rank_list, default=(32, 64, 128, 256, 512),
                       help="candidate predictor ranks, tried from the smallest up until a larger one gains under 2 points of sparsity (default: 32,64,128,256,512)")
    train.add_argument("--steps", type=positive_int, default=1000, help="optimizer steps per fit (default: 1000)")
    add_force_option(train)

    convert = commands.add_parser("convert", help="Hugging Face folder or GGUF -> GGUF (PowerInfer GGUF with predictors)")
    convert.add_argument("source", help="Hugging Face checkpoint folder, GGUF or PowerInfer GGUF file")
    convert.add_argument("predictors", nargs="?", help="predictor directory (model_{i}.pt, config.json) -> PowerInfer GGUF")
    convert.add_argument("--outfile", required=True, help="output file")
    convert.add_argument("--outtype", help="f32, f16, q8_0, q4_0 or q4_1 (default: f16 from Hugging Face, "
                                           "the source's types from GGUF)")
    add_force_option(convert)

    quantize = commands.add_parser("quantize", help="re-encode a (PowerInfer) GGUF's weights (Q4_0 ... Q6_K, llama.cpp's K-quant mixes)")
    quantize.add_argument("input", help="GGUF or PowerInfer GGUF file")
    quantize.add_argument("output", help="output file")
    quantize.add_argument("type", help="Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K (every matrix that type); Q4_K_S, Q4_K_M, "
                                       "Q5_K_S, Q5_K_M (llama.cpp's mixes); POWERINFER_Q4_0 (PowerInfer's: Q4_0, "
                                       "output Q6_K, predictors Q4_0)")
    quantize.add_argument("--allow-requantize", action="store_true",
                          help="also re-encode matrices that are already quantized (adds a second rounding error)")
    add_force_option(quantize)

    place = commands.add_parser("place", help="solve which FFN neurons go to the accelerator for a VRAM budget")
    add_model_source(place, required=True)
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
    add_force_option(place)

    inspect = commands.add_parser("inspect", help="plot activation statistics (the power-law figure)")
    inspect.add_argument("--activations", required=True, help="profile directory (with activation/)")
    inspect.add_argument("-o", "--output", required=True, help="image file (.png, .svg, .pdf, ...)")
    add_force_option(inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = "chat" if getattr(args, "conversation", False) else args.command  # run -cnv is chat
    note_flags_without_effect(args)
    module = importlib.import_module(f"powerinfer.commands.{command.replace('-', '_')}")
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
