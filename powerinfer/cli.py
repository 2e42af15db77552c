"""`powerinfer <command>`: finds the command, which parses its own flags (powerinfer/commands/), and
reports its errors as one line. A command's module is imported only when it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from powerinfer.commands import COMMANDS, command_module
from powerinfer.commands.llama_flags import note_flags_without_effect
from powerinfer.commands.parsing import OneLineParser
from powerinfer.errors import PowerInferError


class VersionAction(argparse.Action):
    """--version: the build, computed only when asked (it imports torch)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from powerinfer.build_info import build_lines

        print("\n".join(build_lines()))
        parser.exit(0)


class CommandLineParser(OneLineParser):
    flags_end_at_first_word = True  # the first word names the command; its parser reads the rest


def build_parser() -> OneLineParser:
    """`powerinfer [--version] COMMAND ...`: the command's own flags are its parser's."""
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:{width}}  {summary}" for name, summary in COMMANDS.items())
    parser = CommandLineParser(prog="powerinfer", description="LLM inference on GGUF models with activation sparsity.",
                               epilog=f"commands:\n{listing}\n\n'powerinfer COMMAND --help' shows a command's flags.",
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=VersionAction, nargs=0,
                        help="print the version, commit, native instruction set, torch version and CUDA, and exit")
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND", help="one of the commands below")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, metavar="...", help="the command's flags")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command's flags as its parser reads them, with `command` naming it."""
    line = build_parser().parse_args(argv)
    args = command_module(line.command).build_parser().parse_args(line.arguments)
    args.command = line.command
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    note_flags_without_effect(args)
    try:
        return command_module(args.command).main(args) or 0
    except PowerInferError as error:
        print(f"powerinfer {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
