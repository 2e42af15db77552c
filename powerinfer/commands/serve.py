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


def main(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from powerinfer.server.app import create_app
    except ImportError as error:
        raise PowerInferError(f"the server needs the 'serve' extra (pip install 'powerinfer[serve]'): {error}") from None
    from powerinfer.commands.common import load_llm, model_path
    from powerinfer.config import ModelConfig
    from powerinfer.gguf.reader import open_gguf

    # A missing, foreign or unsupported file is refused before the server starts; rarer load
    # failures stop the server once it runs (it answers 503 on /health while loading).
    ModelConfig.from_gguf(open_gguf(model_path(args)))
    sock = listen(args.host, args.port)
    failures: list[Exception] = []

    def stop(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(lambda: load_llm(args), parallel=args.parallel, on_load_error=stop)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    host, port = sock.getsockname()[:2]
    print(f"powerinfer serve: listening on http://{host}:{port} ({args.parallel} slots); loading the model ...",
          file=sys.stderr)
    server.run(sockets=[sock])
    if failures:
        raise failures[0]
    return 0
