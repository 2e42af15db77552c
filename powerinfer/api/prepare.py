"""From a validated OpenAI request to the sequences to generate: the prompt (chat template with
tools), sampling, stops, logprobs, the grammar of json answers or tool calls, and `n` choices.

Runs in a worker thread on the server (tokenizing and template rendering take time on big inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from powerinfer.api.echo import Echo
from powerinfer.api.guided import guided_grammar
from powerinfer.api.schemas import ChatRequest, CompletionRequest, OpenAIRequest
from powerinfer.api.tools import ToolFormat, template_messages, tool_format, tool_grammar
from powerinfer.errors import PowerInferError
from powerinfer.runtime.constraint import Constraint, json_schema_grammar
from powerinfer.runtime.sequence import GenerationSequence

if TYPE_CHECKING:
    from powerinfer.llm import LLM

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for text completions (chat runs to the end of the turn)


@dataclass
class Prepared:
    """The sequences of one request (one per choice) and how to present their output."""

    sequences: list[GenerationSequence]
    logprobs: bool
    tools: ToolFormat | None = None
    echo: Echo | None = None  # completions' echo of the prompt
    keep: int | None = None  # best_of: answer with this many of the sequences, the likeliest
    first_index: int = 0  # the number of its first choice (a batch of prompts numbers them on)


def _grammar(llm: LLM, request: OpenAIRequest, tools: ToolFormat | None) -> Constraint | None:
    guides = request.guides()
    if tools is not None:
        if guides:
            raise PowerInferError(f"{guides[0]} with tools: use one or the other")
        grammar = tool_grammar(request, tools)  # type: ignore[arg-type] - only chat requests have tools
    elif guides:
        grammar = guided_grammar(guides[0], getattr(request, guides[0]))
    elif request.response_format is None or request.response_format.type == "text":
        return None
    elif request.response_format.type == "json_object":
        grammar = json_schema_grammar({"type": "object"})
    else:
        grammar = json_schema_grammar(request.response_format.json_schema.schema_)
    return Constraint(llm.tokenizer, llm.config.n_vocab, grammar)


def _sequences(llm: LLM, request: OpenAIRequest, prompt: list[int], max_tokens: int, logprobs: int | None,
               tools: ToolFormat | None = None) -> list[GenerationSequence]:
    sampling = request.sampling()
    bad = [t for t in sampling["logit_bias"] if t >= llm.config.n_vocab]
    if bad:
        raise PowerInferError(f"logit_bias: token id {bad[0]} is out of range (vocabulary of {llm.config.n_vocab})")
    first = llm.new_sequence(prompt, max_tokens, request.stops(), logprobs=logprobs,
                             constraint=_grammar(llm, request, tools), **sampling)
    seed = sampling["seed"]
    # Choice i samples with seed + i: reproducible, and different from the other choices.
    return [first, *(first.fork(None if seed is None else (seed + i) % 2**64) for i in range(1, request.choices))]


def _completion_prompt(llm: LLM, request: CompletionRequest, prompt: str | list[int]) -> list[int]:
    """The prompt's ids; with `suffix`, in the model's fill-in-the-middle order (prefix, suffix, middle)."""
    if not request.suffix:
        return llm.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    fim = llm.tokenizer.fim_ids
    if fim is None:
        raise PowerInferError("suffix: this model has no fill-in-the-middle tokens")
    before = llm.tokenizer.encode(prompt, add_bos=False) if isinstance(prompt, str) else list(prompt)
    bos = [llm.tokenizer.bos_id] if llm.tokenizer.add_bos else []
    return [*bos, fim.prefix, *before, fim.suffix, *llm.tokenizer.encode(request.suffix, add_bos=False), fim.middle]


def prepare_completions(llm: LLM, request: CompletionRequest) -> list[Prepared]:
    """One `Prepared` per prompt of the request, their choices numbered on from the previous ones'."""
    batch = [prepare_completion(llm, request, prompt) for prompt in request.prompts()]
    for k, prepared in enumerate(batch):
        prepared.first_index = k * (prepared.keep or len(prepared.sequences))
    return batch


def prepare_completion(llm: LLM, request: CompletionRequest, prompt: str | list[int]) -> Prepared:
    max_tokens = COMPLETION_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    ids = _completion_prompt(llm, request, prompt)
    ranked = request.choices > (request.n or 1)  # best_of: every sequence's logprobs rank it
    logprobs = request.logprobs if request.logprobs is not None or not ranked else 0
    sequences = _sequences(llm, request, ids, max_tokens, logprobs)  # checks the ids first
    echo = Echo(prompt if isinstance(prompt, str) else llm.detokenize(prompt, special=True), ids, request.logprobs) \
        if request.echo else None
    return Prepared(sequences, logprobs=request.logprobs is not None, echo=echo, keep=request.n or 1 if ranked else None)


def prepare_chat(llm: LLM, request: ChatRequest) -> Prepared:
    template = llm.tokenizer.chat_template
    messages, tools = template_messages(request, template)
    calls = tool_format(request, template)
    limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    top = (request.top_logprobs or 0) if request.logprobs else None
    ids = llm.chat_prompt(messages, tools=tools)
    return Prepared(_sequences(llm, request, ids, llm.n_ctx if limit is None else limit, top, calls),
                    logprobs=request.logprobs, tools=calls)
