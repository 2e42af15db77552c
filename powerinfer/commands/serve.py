"""`powerinfer serve`: the HTTP server (OpenAI-compatible and llama.cpp-style routes)."""

from __future__ import annotations

import argparse
import socket
import sys

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
    """Keys from --api-key and --api-key-file (one a line; blank lines and # comments skipped)."""
    keys = list(args.api_key)
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as file:
                keys += [line.strip() for line in file if line.strip() and not line.lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError) as error:
            raise PowerInferError(f"{args.api_key_file}: cannot read API keys: {error}") from None
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


def main(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from powerinfer.server.app import create_app
    except ImportError as error:
        raise PowerInferError(f"the server needs the 'serve' extra (pip install 'powerinfer[serve]'): {error}") from None
    from powerinfer.commands.common import load_llm, model_path
    from powerinfer.gguf.reader import open_gguf
    from powerinfer.models import read_config

    # A missing, foreign or unsupported file is refused before the server starts; rarer load
    # failures stop the server once it runs (it answers 503 on /health while loading).
    keys, hosts = api_keys(args), allowed_hosts(args)
    read_config(open_gguf(model_path(args)))
    sock = listen(args.host, args.port)
    failures: list[Exception] = []

    def stop(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(lambda: load_llm(args), parallel=args.parallel, on_load_error=stop, allowed_hosts=hosts,
                     api_keys=keys, max_body_size=args.max_body_size, watchdog_seconds=args.watchdog)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:
            # Streams in progress end now with an error event, so connections close and the
            # server exits within seconds even while a scheduler step is stuck.
            app.state.server.begin_shutdown()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    host, port = sock.getsockname()[:2]
    print(f"powerinfer serve: listening on http://{host}:{port} ({args.parallel} slots); loading the model ...",
          file=sys.stderr)
    server.run(sockets=[sock])
    if failures:
        raise failures[0]
    return 0
