"""`powerinfer chat`: an interactive conversation using the model's chat template."""

from __future__ import annotations

import argparse
import sys

from powerinfer.cli import sampling_from_args
from powerinfer.commands.common import load_llm, max_tokens


def main(args: argparse.Namespace) -> int:
    llm = load_llm(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("chatting with", llm.config.name, "- Ctrl-D or /exit to quit", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        stream = llm.chat_stream(messages, max_tokens=max_tokens(args.n_predict, llm), cache_prompt=True,
                                 **sampling_from_args(args))
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": stream.completion.text})
    return 0
