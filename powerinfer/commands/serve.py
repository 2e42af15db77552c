"""`powerinfer serve`: the HTTP server (OpenAI-compatible and llama.cpp-style routes); with --ray, its
app as a Ray Serve deployment of replicas (powerinfer/server/ray_app.py)."""

from __future__ import annotations

import argparse
import faulthandler
import socket
import sys
from pathlib import Path

from powerinfer.cli import RAY_OPTIONS
from powerinfer.errors import PowerInferError


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, so that a taken port is reported before the model loads."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError as error:
        raise PowerInferError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def api_keys(args: argparse.Namespace) -> list[str]:
    """Keys from --api-key and --api-key-file (one a line; # comments skipped). An empty key is
    refused: `--api-key "$KEY"` with KEY unset would otherwise let in every client sending no key."""
    if any(not key.strip() for key in args.api_key):
        raise PowerInferError("--api-key is empty (an unset variable?): give a key, or leave the flag out")
    keys = list(args.api_key)
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                lines = file.read().splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise PowerInferError(f"{args.api_key_file}: cannot read API keys: {error}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                raise PowerInferError(f"{args.api_key_file}: line {number} is empty (an empty key is no key)")
            if not line.lstrip().startswith("#"):
                keys.append(line.strip())
        if len(keys) == len(args.api_key):
            raise PowerInferError(f"{args.api_key_file}: no API keys in the file")
    if any(not key.isprintable() or " " in key for key in keys):
        raise PowerInferError("API keys must be printable and without spaces")
    return keys


def allowed_hosts(args: argparse.Namespace) -> frozenset[str] | None:
    from powerinfer.server.gate import default_allowed_hosts

    if args.allowed_hosts is None:
        return default_allowed_hosts(args.host)
    names = {name.strip().lower() for name in args.allowed_hosts.split(",") if name.strip()}
    return None if "*" in names else frozenset(names)


def app_options(args: argparse.Namespace) -> dict:
    """create_app's keywords from the flags, alike for one server and for each Ray replica."""
    from powerinfer.server.model_names import ModelNames

    return dict(parallel=args.parallel, allowed_hosts=allowed_hosts(args), api_keys=api_keys(args),
                max_body_size=args.max_body_size, watchdog_seconds=args.watchdog, body_timeout=args.read_timeout,
                max_body_memory=args.max_body_memory, max_embedding_tokens=args.max_embedding_tokens,
                model_names=ModelNames.of(args.alias, args.strict_model_name))


def checked_model(args: argparse.Namespace) -> Path:
    """The model file; a missing, foreign or unsupported one is refused before any server starts,
    and so are -c and --parallel whose KV cache this machine can never hold (its float16 size)."""
    import torch

    from powerinfer.commands.common import model_path
    from powerinfer.gguf.reader import open_gguf
    from powerinfer.llm import DEFAULT_N_CTX
    from powerinfer.models import read_config
    from powerinfer.runtime.kv_cache import cache_bytes, check_cache_fits

    path = model_path(args)
    config = read_config(open_gguf(path))
    n_ctx = args.ctx_size or min(DEFAULT_N_CTX, config.n_ctx_train)
    check_cache_fits(cache_bytes(config.n_layers, args.parallel, config.n_head_kv, n_ctx, config.head_dim,
                                 torch.float16), args.parallel, n_ctx)
    return path


def main(args: argparse.Namespace) -> int:
    stray = [name for name in RAY_OPTIONS if getattr(args, name) is not None]
    if stray and not args.ray:
        raise PowerInferError(f"--{stray[0].replace('_', '-')} needs --ray")
    if args.ray:
        from powerinfer.server.ray_app import serve_on_ray

        return serve_on_ray(args)
    try:
        import uvicorn

        from powerinfer.server.app import create_app
        from powerinfer.server.connections import ConnectionLimits, server_config
        from powerinfer.server.request_log import configure_logging
    except ImportError as error:
        raise PowerInferError(f"the server needs the 'serve' extra (pip install 'powerinfer[serve]'): {error}") from None
    from powerinfer.commands.common import load_chat_llm

    # A model file rewritten in place while mapped (cp over it, truncate) faults on the next read
    # of a missing page: say so on stderr, with every thread's stack, rather than die silently.
    if sys.__stderr__ is not None:  # the process's own stderr, even while sys.stderr is replaced
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    # A missing, foreign or unsupported file is refused before the server starts; rarer load
    # failures stop the server once it runs (it answers 503 on /health while loading).
    options = app_options(args)
    checked_model(args)
    sock = listen(args.host, args.port)
    failures: list[Exception] = []

    def stop(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(lambda: load_chat_llm(args), on_load_error=stop, **options)

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
