"""The flags of the commands that generate (run, chat; serve takes the chat template's): the
prompt, its length and stop strings, llama.cpp's sampling flags, the chat template."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from powerinfer.commands.files import read_text
from powerinfer.commands.model_flags import (
    add_context_option,
    add_model_options,
    add_sparsity_options,
    sparsity_settings,
)
from powerinfer.commands.parsing import non_negative_float, non_negative_int, number, positive_float, utf8_text
from powerinfer.errors import PowerInferError
from powerinfer.options import (
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_REPEAT_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
)

if TYPE_CHECKING:
    from powerinfer.llm import LLM


def add_generation_options(parser: argparse.ArgumentParser, chat: bool) -> None:
    """What run and chat share: a model, a prompt, a system prompt, a length, stop strings, sampling."""
    add_model_options(parser)
    add_context_option(parser)
    add_sparsity_options(parser)
    prompt = parser.add_mutually_exclusive_group()
    first = "the first user message" if chat else "prompt text (with -cnv: the first user message)"
    prompt.add_argument("-p", "--prompt", type=utf8_text, help=first)
    prompt.add_argument("-f", "--file", help=f"read {'the first user message' if chat else 'the prompt'} from this file")
    parser.add_argument("-sys", "--system-prompt", "--system", dest="system", type=utf8_text,
                        help="system message" + ("" if chat else " (with -cnv)"))
    parser.add_argument("-n", "--n-predict", type=number(int, -1), default=-1,
                        help=f"tokens {'per reply' if chat else 'to generate'}; -1 = until the end of "
                             f"{'the turn' if chat else 'text'} or the context (default: %(default)s)")
    parser.add_argument("--stop", action="append", default=[], type=utf8_text, help="stop string (repeatable)")
    add_chat_template_options(parser)
    add_sampling_options(parser)


def generation_settings(args: argparse.Namespace) -> dict[str, Any]:
    """LLM keywords from the flags `add_generation_options` adds beyond the model's."""
    return dict(n_ctx=args.ctx_size, chat_template=args.chat_template, **sparsity_settings(args))


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling flags, range-checked here so that a bad value stops before the model loads."""
    parser.add_argument("--temp", type=non_negative_float, default=DEFAULT_TEMPERATURE,
                        help="temperature; 0 = greedy (default: %(default)s)")
    parser.add_argument("--top-k", type=non_negative_int, default=DEFAULT_TOP_K,
                        help="top-k sampling; 0 = off (default: %(default)s)")
    parser.add_argument("--top-p", type=number(float, 0, 1, above=True), default=DEFAULT_TOP_P,
                        help="top-p (nucleus) sampling; 1 = off (default: %(default)s)")
    parser.add_argument("--min-p", type=number(float, 0, 1), default=DEFAULT_MIN_P,
                        help="min-p sampling; 0 = off (default: %(default)s)")
    parser.add_argument("--repeat-penalty", type=positive_float, default=DEFAULT_REPEAT_PENALTY,
                        help="repetition penalty; 1 = off (default: %(default)s)")
    parser.add_argument("--repeat-last-n", type=non_negative_int, default=DEFAULT_REPEAT_LAST_N,
                        help="tokens the repetition penalty looks back over (default: %(default)s)")
    parser.add_argument("-s", "--seed", type=number(int, -1), default=-1, help="random seed; -1 = random (default: %(default)s)")


def sampling_settings(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams' keywords from `add_sampling_options`' flags."""
    return dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                seed=None if args.seed == -1 else args.seed)


def add_chat_template_options(parser: argparse.ArgumentParser) -> None:
    """--chat-template NAME|FILE, and llama.cpp's --jinja (our templates are always Jinja)."""
    from powerinfer.chat_formats import BUILT_IN, chosen_template

    def template_spec(text: str) -> str:
        try:
            chosen_template(text)  # refused here, before any model loads
        except PowerInferError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    template_spec.__name__ = "chat template"
    parser.add_argument("--chat-template", type=template_spec, metavar="NAME|FILE",
                        help=f"chat template instead of the file's: a built-in ({', '.join(BUILT_IN)}) or a Jinja file "
                             "(default: the file's; without one, a built-in chosen by architecture and tokens)")
    parser.add_argument("--jinja", action="store_true", help="accepted for llama.cpp habits: templates are always Jinja here")


def announce_template(llm: LLM, chat_template: str | None) -> LLM:
    """`llm`, after one line on stderr naming the built-in template a file without one gets
    (unless --chat-template chose it)."""
    origin = llm.tokenizer.chat_template_origin
    if chat_template is None and origin.startswith("built-in"):
        print(f"powerinfer: {llm.path.name} has no chat template: using the {origin} template "
              "(--chat-template NAME|FILE for another)", file=sys.stderr)
    return llm


def max_tokens(n_predict: int, llm: LLM) -> int:
    """-n: -1 runs to the end of the context."""
    return llm.n_ctx if n_predict < 0 else n_predict


def read_prompt(args: argparse.Namespace) -> str | None:
    """The text of -p, or of the -f file; None when neither is given."""
    return args.prompt if args.file is None else read_text(args.file)
