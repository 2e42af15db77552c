"""`powerinfer serve`: the HTTP server (OpenAI-compatible and llama.cpp-style routes); with --ray, its
app as a Ray Serve deployment of replicas (powerinfer/server/ray_app.py)."""

from __future__ import annotations

import argparse
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


def app_options(args: argparse.Namespace) -> dict:
    """create_app's keywords from the flags, alike for one server and for each Ray replica."""
    return dict(parallel=args.parallel)


def checked_model(args: argparse.Namespace) -> Path:
    """The model file; a missing, foreign or unsupported one is refused before any server starts."""
    from powerinfer.gguf.reader import open_gguf
    from powerinfer.hub import resolve_model
    from powerinfer.models import read_config

    path = resolve_model(args.model)
    read_config(open_gguf(path))
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
    except ImportError as error:
        raise PowerInferError(f"the server needs the 'serve' extra (pip install 'powerinfer[serve]'): {error}") from None
    from powerinfer.commands.run import load_llm

    # Rarer load failures than checked_model's stop the server once it runs (it answers 503 on
    # /health while loading).
    checked_model(args)
    sock = listen(args.host, args.port)
    failures: list[Exception] = []

    def stop(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(lambda: load_llm(args), on_load_error=stop, **app_options(args))
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    host, port = sock.getsockname()[:2]
    print(f"powerinfer serve: listening on http://{host}:{port} ({args.parallel} slots); loading the model ...",
          file=sys.stderr)
    server.run(sockets=[sock])
    if failures:
        raise failures[0]
    return 0
