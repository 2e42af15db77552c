"""`powerinfer run`: complete a prompt, text on stdout, timings on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from powerinfer.commands import chat
from powerinfer.commands.generation_flags import (
    add_generation_options,
    generation_settings,
    max_tokens,
    read_prompt,
    sampling_settings,
)
from powerinfer.commands.model_flags import load_llm
from powerinfer.commands.parsing import OneLineParser, command_parser
from powerinfer.errors import PowerInferError

if TYPE_CHECKING:
    from powerinfer.runtime.sequence import Completion


def build_parser() -> OneLineParser:
    parser = command_parser("run")
    add_generation_options(parser, chat=False)
    conversation = parser.add_mutually_exclusive_group()
    conversation.add_argument("-cnv", "--conversation", action="store_true", help="chat instead (the chat command)")
    conversation.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_false",
                              help="complete the prompt (the default)")
    return parser


def print_timings(completion: Completion, load_seconds: float | None = None, sparsity: bool = False) -> None:
    """llama.cpp's timing lines on stderr; with `sparsity`, the share of FFN work skipped too."""
    t = completion.timings
    lines = []
    if load_seconds is not None:
        lines.append(f"load time        = {load_seconds * 1e3:10.2f} ms")
    lines.append(f"prompt eval time = {t.prompt_seconds * 1e3:10.2f} ms / {t.prompt_tokens:5d} tokens "
                 f"({t.prompt_seconds * 1e3 / max(t.prompt_tokens, 1):8.2f} ms per token, {t.prompt_tokens_per_second:8.2f} tokens per second)")
    lines.append(f"       eval time = {t.decode_seconds * 1e3:10.2f} ms / {t.decode_steps:5d} runs   "
                 f"({t.decode_seconds * 1e3 / max(t.decode_steps, 1):8.2f} ms per token, {t.decode_tokens_per_second:8.2f} tokens per second)")
    if sparsity and t.ffn_share_skipped is not None:
        lines.append(f"sparsity         = {t.ffn_share_skipped:10.1%} of FFN neurons skipped per token")
    print("\n" + "\n".join(lines), file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    if args.conversation:  # llama-cli's -cnv: run's flags are chat's
        return chat.main(args)
    prompt = read_prompt(args)
    if prompt is None:
        raise PowerInferError("one of -p/--prompt or -f/--file is required (or -cnv to chat)")
    if args.system is not None:
        raise PowerInferError("-sys/--system-prompt sets a conversation's system message: add -cnv (or use chat)")
    llm = load_llm(args, **generation_settings(args))
    stream = llm.generate_stream(prompt, max_tokens=max_tokens(args.n_predict, llm), stop=args.stop, **sampling_settings(args))
    print(f"powerinfer: {llm.summary()}", file=sys.stderr)  # once the prompt is known to fit: a refusal is one line
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print_timings(stream.completion, llm.load_seconds, sparsity=llm.sparsity != "off")
    return 0
