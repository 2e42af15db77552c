"""llama.cpp's and vLLM's flags that users bring along: each works here, or is accepted with one
line on stderr saying why it has no effect (never silently, never refused)."""

from __future__ import annotations

import argparse
import sys

from powerinfer.commands.parsing import positive_int
from powerinfer.errors import PowerInferError
from powerinfer.options import CACHE_TYPE_NAMES, DEFAULT_N_BATCH

# dest -> why the flag changes nothing here
NO_EFFECT = {
    "ubatch_size": "-ub: a prompt batch (-b) runs as one pass here, there is no smaller physical batch",
    "flash_attn": "-fa: attention always runs our own fused kernel over the KV cache; there is no other path to choose",
    "no_mmap": "--no-mmap: the file is always memory-mapped and its weights repacked at load; nothing to turn off",
    "mlock": "--mlock: the weights are repacked into memory of our own at load, which is not locked",
    "embeddings": "--embeddings: /v1/embeddings is always served",
    "metrics": "--metrics: /metrics is always served",
    "cont_batching": "-cb: continuous batching is always on (--parallel slots)",
}


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """What every command that loads a model takes from llama.cpp."""
    parser.add_argument("-b", "--batch-size", type=positive_int, default=DEFAULT_N_BATCH, metavar="N",
                        help="prompt tokens evaluated per forward pass (default: %(default)s)")
    parser.add_argument("-ub", "--ubatch-size", type=positive_int, metavar="N", help="accepted; no effect here")
    parser.add_argument("-fa", "--flash-attn", nargs="?", const="on", choices=["on", "off", "auto"],
                        help="accepted; no effect here (attention has one kernel)")
    parser.add_argument("-ctv", "--cache-type-v", choices=CACHE_TYPE_NAMES,
                        help="KV cache type; keys and values share one type here, so it must agree with -ctk")
    parser.add_argument("--no-mmap", action="store_true", help="accepted; no effect here")
    parser.add_argument("--mlock", action="store_true", help="accepted; no effect here")


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """llama-server's and vLLM's serving flags (the model's flags come with `add_model_flags`)."""
    parser.add_argument("-a", "--alias", "--served-model-name", dest="alias", nargs="+", action="extend",
                        metavar="NAME", help="names to serve the model under, listed by /v1/models "
                                             "(default: the file's name)")
    parser.add_argument("--strict-model-name", action="store_true",
                        help="refuse requests naming another model (404) rather than answer them with this one")
    parser.add_argument("--embeddings", action="store_true", help="accepted; /v1/embeddings is always served")
    parser.add_argument("--metrics", action="store_true", help="accepted; /metrics is always served")
    parser.add_argument("-cb", "--cont-batching", action="store_true", help="accepted; continuous batching is always on")
    parser.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="the server's log lines, one per request among them: text or one JSON object a line "
                             "(default: text)")


def cache_type(args: argparse.Namespace) -> str | None:
    """The KV cache type from -ctk and -ctv (one type for both here)."""
    keys, values = args.cache_type, args.cache_type_v
    if keys and values and keys != values:
        raise PowerInferError(f"-ctk {keys} and -ctv {values} differ: keys and values share one cache type here")
    return keys or values


def note_flags_without_effect(args: argparse.Namespace) -> None:
    for dest, why in NO_EFFECT.items():
        if getattr(args, dest, None):  # each command has its own subset of these flags
            print(f"powerinfer: {why}", file=sys.stderr)
