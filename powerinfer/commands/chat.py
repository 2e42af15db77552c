"""`powerinfer chat`: an interactive conversation using the model's chat template.

Ctrl-C while a reply streams stops that reply and keeps the session; Ctrl-C or Ctrl-D at the
prompt ends it. Lines starting with / are commands, never sent to the model. When the conversation
outgrows the context, the oldest turns are dropped (the system prompt stays).
"""

from __future__ import annotations

import argparse
import signal
import sys

from powerinfer.commands.generation_flags import (
    add_generation_options,
    announce_template,
    generation_settings,
    max_tokens,
    read_prompt,
    sampling_settings,
)
from powerinfer.commands.model_flags import load_llm
from powerinfer.commands.parsing import OneLineParser, command_parser, is_utf8
from powerinfer.errors import PowerInferError

COMMANDS = {
    "/help": "show these commands",
    "/clear": "forget the conversation (the system prompt stays)",
    "/exit": "quit (also /quit, Ctrl-D, or Ctrl-C at the prompt)",
}
QUIT_COMMANDS = ("/exit", "/quit")


def build_parser() -> OneLineParser:
    parser = command_parser("chat")
    add_generation_options(parser, chat=True)
    parser.add_argument("-cnv", "--conversation", action="store_true", default=True,
                        help="accepted for llama.cpp habits: chat always converses")
    return parser


def note(text: str) -> None:
    """A line for the person chatting, kept off stdout (which carries only the replies)."""
    print(f"[{text}]", file=sys.stderr, flush=True)


class StopOnInterrupt:
    """While active, Ctrl-C sets `requested` instead of raising KeyboardInterrupt: the reply loop
    checks it between tokens, so a decode step is never cut midway and the KV cache stays valid
    for the next turn."""

    def __enter__(self) -> StopOnInterrupt:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._request)
        return self

    def _request(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


class Conversation:
    def __init__(self, llm, system: str | None):
        self.llm = llm
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, str]] = []

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.system + self.turns

    def clear(self) -> None:
        self.turns = []

    def prompt_tokens(self) -> int:
        return len(self.llm.chat_prompt(self.messages))

    def make_room(self, reserve: int) -> bool:
        """Drop the oldest exchanges until the prompt leaves `reserve` tokens for the reply (the
        system prompt and the newest user message always stay). False when even those do not fit."""
        dropped = 0
        while self.prompt_tokens() + reserve > self.llm.n_ctx and len(self.turns) > 1:
            del self.turns[0]  # a user message, then its reply
            while len(self.turns) > 1 and self.turns[0]["role"] != "user":
                del self.turns[0]
            dropped += 1
        if dropped:
            note(f"context full: dropped the {dropped} oldest turn{'s' * (dropped > 1)} "
                 f"(context of {self.llm.n_ctx} tokens)")
        return self.prompt_tokens() < self.llm.n_ctx


def reply(conversation: Conversation, args: argparse.Namespace) -> None:
    """Stream the assistant's answer to the conversation's last message and record it."""
    llm = conversation.llm
    limit = max_tokens(args.n_predict, llm)
    if not conversation.make_room(reserve=min(limit, llm.n_ctx // 4)):
        note(f"message too long: {conversation.prompt_tokens()} tokens do not fit the context of {llm.n_ctx}; not sent")
        conversation.turns.pop()
        return
    stream = llm.chat_stream(conversation.messages, max_tokens=limit, stop=args.stop, cache_prompt=True,
                             **sampling_settings(args))
    pieces = []
    with StopOnInterrupt() as interrupt:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
            pieces.append(piece)
            if interrupt.requested:
                break
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupt.requested:
        note("reply stopped")
    elif stream.completion.finish_reason == "length" and \
            stream.completion.prompt_tokens + len(stream.completion.tokens) >= llm.n_ctx:
        note(f"reply cut: the context of {llm.n_ctx} tokens is full; the oldest turns go next time")
    conversation.turns.append({"role": "assistant", "content": "".join(pieces)})


def run_command(line: str, conversation: Conversation) -> bool:
    """Carry out a /command; False when it ends the session."""
    name = line.split()[0].lower()
    if name in QUIT_COMMANDS:
        return False
    if name == "/clear":
        conversation.clear()
        note("conversation cleared" + (" (system prompt kept)" if conversation.system else ""))
    elif name == "/help":
        for command, text in COMMANDS.items():
            print(f"  {command:8s} {text}", file=sys.stderr)
    else:
        note(f"unknown command {name}: /help lists the commands")
    return True


def main(args: argparse.Namespace) -> int:
    first = read_prompt(args)
    llm = announce_template(load_llm(args, **generation_settings(args)), args.chat_template)
    conversation = Conversation(llm, args.system)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"chatting with {llm.config.name}: /help for commands, Ctrl-C stops a reply, Ctrl-D quits",
              file=sys.stderr)
    pending = [first] if first else []
    while True:
        if pending:
            line = pending.pop()
            if interactive:
                print(f"> {line}")
        else:
            try:
                line = input("> " if interactive else "")
            except (EOFError, KeyboardInterrupt):
                if interactive:
                    print(file=sys.stderr)
                return 0
        line = line.strip()
        if not line:
            continue
        if not is_utf8(line):
            raise PowerInferError("the input is not valid UTF-8 text")
        if line.startswith("/"):
            if not run_command(line, conversation):
                return 0
            continue
        conversation.turns.append({"role": "user", "content": line})
        reply(conversation, args)
