"""`powerinfer serve`: the HTTP server (OpenAI-compatible and llama.cpp-style routes); with --ray, its
app as a Ray Serve deployment of replicas (powerinfer/server/ray_app.py)."""

from __future__ import annotations

import argparse
import faulthandler
import sys
from typing import Any

from powerinfer.commands.generation_flags import add_chat_template_options, announce_template
from powerinfer.commands.llama_flags import add_server_flags
from powerinfer.commands.model_flags import (
    add_context_option,
    add_model_options,
    add_sparsity_options,
    llm_settings,
    sparsity_settings,
)
from powerinfer.commands.parsing import (
    OneLineParser,
    command_parser,
    non_negative_float,
    non_negative_int,
    number,
    positive_float,
    positive_int,
)
from powerinfer.errors import PowerInferError
from powerinfer.ops import native
from powerinfer.server.limits import (
    DEFAULT_KEEP_ALIVE,
    DEFAULT_MAX_BODY_MEMORY,
    DEFAULT_MAX_BODY_SIZE,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_EMBEDDING_TOKENS,
    DEFAULT_READ_TIMEOUT,
    DEFAULT_WATCHDOG_SECONDS,
)
from powerinfer.server.startup import app_options, check_model, listen

RAY_OPTIONS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "address", "num_cpus", "num_gpus")


def build_parser() -> OneLineParser:
    parser = command_parser("serve")
    add_model_options(parser)
    add_context_option(parser)
    add_sparsity_options(parser)
    add_chat_template_options(parser)
    add_server_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=number(int, 0, 65535), default=8080,
                        help="port (default: %(default)s; 0 = any free port)")
    parser.add_argument("-np", "--parallel", type=positive_int, default=4,
                        help="sequences decoded together (KV-cache slots); more requests wait in a queue (default: %(default)s)")
    parser.add_argument("--max-body-size", type=positive_int, default=DEFAULT_MAX_BODY_SIZE, metavar="BYTES",
                        help=f"largest request body accepted; larger ones get 413 (default: {mib(DEFAULT_MAX_BODY_SIZE)})")
    parser.add_argument("--allowed-hosts", metavar="NAMES",
                        help="comma-separated names the Host header may carry, '*' for any "
                             "(default: loopback names when --host is a loopback address, else any)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (repeat for several keys)")
    parser.add_argument("--api-key-file", metavar="FILE", help="file of API keys, one a line")
    parser.add_argument("--watchdog", type=positive_float, default=DEFAULT_WATCHDOG_SECONDS, metavar="SECONDS",
                        help="/health answers 503 when queued work has waited this long for a scheduler step "
                             "(default: %(default)g)")
    add_ray_options(parser)
    add_limit_options(parser)
    return parser


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
    group.add_argument("--read-timeout", type=number(float, 0, 3600, above=True), default=DEFAULT_READ_TIMEOUT, metavar="SECONDS",
                       help="a request's headers, then its body, must each arrive within this long; slower ones "
                            "get 408 and are closed (default: %(default)g)")
    group.add_argument("--keep-alive", type=number(float, 0, 3600, above=True), default=DEFAULT_KEEP_ALIVE, metavar="SECONDS",
                       help="an idle kept-alive connection is closed after this long (default: %(default)g)")
    group.add_argument("--max-connections", type=number(int, 1, 1_000_000), default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                       help="beyond this many connections or requests in progress, requests get 503 (default: %(default)s)")
    group.add_argument("--max-body-memory", type=number(int, 1, 2**40), default=DEFAULT_MAX_BODY_MEMORY, metavar="BYTES",
                       help="bytes of all the request bodies being read at once; a body that would pass it gets 503 "
                            f"(default: {mib(DEFAULT_MAX_BODY_MEMORY)})")
    group.add_argument("--max-embedding-tokens", type=number(int, 1, 2**31), default=DEFAULT_MAX_EMBEDDING_TOKENS, metavar="N",
                       help="tokens one /v1/embeddings request may ask for, its inputs together; more get 400 "
                            "(default: %(default)s)")


def mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


def serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The served model's LLM keywords (its file found, fetched if need be), alike for one server and
    for each Ray replica."""
    return llm_settings(args, n_ctx=args.ctx_size, chat_template=args.chat_template, parallel=args.parallel,
                        **sparsity_settings(args))


MODEL_CHANGED_EXIT = 74  # sysexits' EX_IOERR: the served file failed under the server


def exit_if_the_model_changes(model: Any) -> None:
    """A model file rewritten in place while mapped (cp over it, truncate) faults on the next read
    of a page it lost (SIGBUS, inside a kernel): the native handler makes that one line and exit
    status MODEL_CHANGED_EXIT. Without the native module, faulthandler prints every thread's stack:
    never a silent death."""
    if sys.__stderr__ is not None:  # the process's own stderr, even while sys.stderr is replaced
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    ops = native.load()
    if ops is not None:
        ops.exit_on_bus_error(f"powerinfer serve: error: {model} was changed while served (truncated or rewritten "
                              "in place, as cp does); exiting. Replace a served file by a rename (mv).\n",
                              MODEL_CHANGED_EXIT)


def main(args: argparse.Namespace) -> int:
    stray = [name for name in RAY_OPTIONS if vars(args)[name] is not None]
    if stray and not args.ray:
        raise PowerInferError(f"--{stray[0].replace('_', '-')} needs --ray")
    if args.ray:
        from powerinfer.server import ray_app

        # bad flags and a missing 'ray' extra are refused before the model is looked for (and fetched)
        ray_app.deployment_options(args)
        ray_app.import_ray(args.address)
        return ray_app.serve_on_ray(args, serve_settings(args))
    try:
        import uvicorn

        from powerinfer.server.app import create_app
        from powerinfer.server.connections import ConnectionLimits, server_config
        from powerinfer.server.request_log import configure_logging
    except ImportError as error:
        raise PowerInferError(f"the server needs the 'serve' extra (pip install 'powerinfer[serve]'): {error}") from None
    from powerinfer.llm import LLM

    # A missing, foreign or unsupported file is refused before the server starts; rarer load
    # failures stop the server once it runs (it answers 503 on /health while loading).
    options = app_options(args)
    settings = serve_settings(args)
    check_model(settings["model"], args.ctx_size, args.parallel)
    exit_if_the_model_changes(settings["model"])
    sock = listen(args.host, args.port)
    failures: list[Exception] = []

    def stop(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(lambda: announce_template(LLM(**settings), args.chat_template), on_load_error=stop, **options)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # Streams in progress end now with an error event, so connections close and the
            # server exits within seconds even while a scheduler step is stuck.
            app.state.server.begin_shutdown()
            super().handle_exit(sig, frame)

    limits = ConnectionLimits(args.read_timeout, args.keep_alive, args.max_connections)
    configure_logging(args.log_format)
    # our request lines replace uvicorn's access log; in json mode we format uvicorn's lines too
    server = Server(server_config(app, limits, log_level="info", timeout_graceful_shutdown=5, access_log=False,
                                  **({"log_config": None} if args.log_format == "json" else {})))
    host, port = sock.getsockname()[:2]
    print(f"powerinfer serve: listening on http://{host}:{port} ({args.parallel} slots); loading the model ...",
          file=sys.stderr)
    server.run(sockets=[sock])
    if failures:
        raise failures[0]
    return 0
