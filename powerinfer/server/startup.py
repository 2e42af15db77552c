"""What the server settles before it starts, alike for one server and for Ray's replicas: the
listening socket, the model file checked, and `create_app`'s keywords from `serve`'s flags."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

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
    """The names the Host header may carry (--allowed-hosts, else by --host); None for any."""
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


def check_model(path: Path, n_ctx: int | None, parallel: int) -> None:
    """Refuses a missing, foreign or unsupported model file before any server starts, and a context
    (None: the model's default) and slot count whose KV cache this machine can never hold (its
    float16 size)."""
    import torch

    from powerinfer.gguf.reader import open_gguf
    from powerinfer.models import read_config
    from powerinfer.options import context_size
    from powerinfer.runtime.kv_cache import cache_bytes, check_cache_fits

    config = read_config(open_gguf(path))
    n_ctx = context_size(n_ctx, config.n_ctx_train)
    check_cache_fits(cache_bytes(config.n_layers, parallel, config.n_head_kv, n_ctx, config.head_dim, torch.float16),
                     parallel, n_ctx)
