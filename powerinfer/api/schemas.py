"""Request bodies, validated by pydantic (a failure is a 400 answer from the server and a
`PowerInferError` from the Python API).

Ranges are checked here, before a request reaches the scheduler: a value the sampler cannot use
must be refused, not fail later. Text must be valid Unicode: JSON can spell a lone surrogate
("\\ud800"), which no tokenizer takes.

Fields OpenAI defines that we do not implement are refused by name when they ask for something
(`UNSUPPORTED`), never ignored; a field nobody defines is ignored with a warning in the log, as
vLLM does (clients add their own fields).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from powerinfer.options import (
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_REPEAT_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
)

log = logging.getLogger(__name__)

# Temperatures below this (but above 0) and repetition penalties outside the range below could
# overflow float32 logits to inf; 0 stays greedy.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3
PENALTY_RANGE = (1e-3, 1e3)
MAX_STOPS = 16
MAX_STOP_LENGTH = 4096  # characters per stop string
SURROGATE = re.compile("[\ud800-\udfff]")

Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # what torch's generator takes; < 0: random
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]
RepeatPenalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])]
StopText = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None
# Lists are counted before their items are validated (pydantic checks max_length only after), so
# an oversized list costs its parsing, not its validation (powerinfer/server/bodies.py).
MAX_TOKEN_IDS = 1 << 18
MAX_MESSAGES = 1 << 14


def at_most(limit: int) -> BeforeValidator:
    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} items, got {len(value)}")
        return value

    return BeforeValidator(check)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], at_most(MAX_TOKEN_IDS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
LogitBias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100.0, le=100.0)]]
MAX_CHOICES = 16
MAX_BATCH = 64  # prompts in one /v1/completions request
MAX_GUIDE_LENGTH = 65536  # characters of a guided regex, choice or grammar
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


MAX_JSON_VALUES = 1 << 19  # values in one body: the budget of the walk below and of the validation after it
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in one body
TOO_MANY_VALUES = f"the body holds more than {MAX_JSON_VALUES} JSON values"
TOO_DEEP = f"the body is nested more than {MAX_JSON_DEPTH} levels deep"


def _check_unicode(value: Any) -> None:
    """Refuse strings holding UTF-16 surrogates, anywhere in the JSON value; and values with more
    than MAX_JSON_VALUES parts or nested deeper than MAX_JSON_DEPTH (iterative: any depth is safe)."""
    pending, counted = [(value, 0)], 1
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            if SURROGATE.search(item):
                raise ValueError("text holds a lone UTF-16 surrogate (not valid Unicode)")
        elif isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(TOO_DEEP)
            counted += 2 * len(item) if isinstance(item, dict) else len(item)
            if counted > MAX_JSON_VALUES:  # counted before walking: an oversized list costs nothing more
                raise ValueError(TOO_MANY_VALUES)
            parts = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            pending.extend((part, depth + 1) for part in parts if isinstance(part, (str, dict, list)))


class Sampling(Body):
    """Sampling fields shared by every generation route (top_k, min_p, repeat_penalty as in llama.cpp)."""

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = DEFAULT_TOP_K
    min_p: MinP = DEFAULT_MIN_P
    repeat_penalty: RepeatPenalty = DEFAULT_REPEAT_PENALTY
    repeat_last_n: Annotated[int, Field(ge=0)] = DEFAULT_REPEAT_LAST_N
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    seed: Seed | None = None
    stop: Stop = None

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    def sampling(self) -> dict:
        """Keyword arguments for `SamplingParams`."""
        seed = self.seed if self.seed is not None and self.seed >= 0 else None
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n, seed=seed,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()})

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class StreamOptions(Body):
    include_usage: bool = False


class JSONSchemaFormat(Body):
    name: Name = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only then")
        return self


class UnsupportedFields(ValueError):
    """Fields OpenAI defines, asking for something we do not do."""

    def __init__(self, fields: list[str]):
        super().__init__(f"unsupported field{'s' if len(fields) > 1 else ''}: {', '.join(fields)}")
        self.fields = fields


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line for pydantic's (or FastAPI's) validation errors, and the top-level field to blame."""
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    cause = first.get("ctx", {}).get("error")
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        return f"the request body is not valid JSON{f' ({cause})' if cause else ''}", None
    if isinstance(cause, UnsupportedFields):
        return str(cause), cause.fields[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # The message shows the whole path (union members included); param names the top-level field.
    return f"{'.'.join(loc) or 'request body'}: {first['msg']}", (loc[0] if loc else None)


def _unset(value: Any) -> bool:
    return value is None


class OpenAIRequest(Sampling):
    """Fields both OpenAI routes take. `UNSUPPORTED` maps each field OpenAI defines that we do not
    implement to the values that ask for nothing (accepted as no-ops)."""

    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {}

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None  # a caller's tag for its end users; nothing to do with it here
    # vLLM's guided decoding (powerinfer/api/guided.py), at most one of them
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, Field(min_length=1, max_length=MAX_GUIDE_LENGTH)] | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_GUIDE_LENGTH)]],
                             Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: Annotated[str, Field(min_length=1, max_length=MAX_GUIDE_LENGTH)] | None = None
    guided_decoding_backend: str | None = None  # vLLM's choice of engine: ours is llguidance, whatever it names
    guided_whitespace_pattern: None = None  # vLLM's JSON whitespace: ours is fixed (any value is refused)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            asked = [k for k, harmless in cls.UNSUPPORTED.items() if k in data and not harmless(data[k])]
            if asked:
                raise UnsupportedFields(asked)
        return data

    @model_validator(mode="after")
    def _note_unknown(self) -> OpenAIRequest:
        unknown = sorted(set(self.model_extra or {}) - set(self.UNSUPPORTED))
        if unknown:
            log.warning("ignoring %d fields nobody defines: %s", len(unknown), ", ".join(unknown[:20]))
        return self

    @model_validator(mode="after")
    def _one_guide(self) -> OpenAIRequest:
        guides = self.guides()
        if len(guides) > 1:
            raise ValueError(f"{' and '.join(guides)}: give one guided_* field at most")
        if guides and self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"{guides[0]} with response_format: use one or the other")
        return self

    def guides(self) -> list[str]:
        """The guided_* fields given (vLLM's)."""
        return [name for name in GUIDED_FIELDS if getattr(self, name) is not None]

    @property
    def choices(self) -> int:
        return self.n or 1


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions. A prompt is text or token ids, or a batch of either (each prompt gets
    its n choices, numbered prompt by prompt as OpenAI numbers them)."""

    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_BATCH)]
    logprobs: TopLogprobs | None = None
    echo: bool | None = False  # the prompt first, with its logprobs when asked (powerinfer/api/echo.py)
    suffix: str | None = None  # fill in the middle, between the prompt and this
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None  # sample this many, answer the likeliest n

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.stream and (self.best_of or 1) > (self.n or 1):
            raise ValueError("best_of greater than n cannot stream (the best are known only at the end)")
        return self

    @property
    def choices(self) -> int:
        """Sequences to generate: best_of of them when given."""
        return self.best_of or self.n or 1

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a list of texts or of token lists, else the one prompt."""
        batch = isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], str | list)
        return list(self.prompt) if batch else [self.prompt]


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: Name
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(Body):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(Body):
    name: Name


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ChosenFunction


class ChatRequest(OpenAIRequest):
    """POST /v1/chat/completions."""

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "audio": _unset, "prediction": _unset, "web_search_options": _unset, "reasoning_effort": _unset,
        "functions": _unset, "function_call": _unset, "metadata": _unset, "prompt_cache_key": _unset,
        "safety_identifier": _unset, "verbosity": _unset,
        "modalities": lambda v: v is None or v == ["text"],
        "store": lambda v: v in (None, False),
        "service_tier": lambda v: v in (None, "auto", "default"),
    }

    messages: Annotated[list[Message], Field(min_length=1), at_most(MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @model_validator(mode="after")
    def _tools_consistent(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.calls_tools and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("response_format with tools is not supported: use one or the other")
        return self

    @property
    def calls_tools(self) -> bool:
        """Tools are offered and the model may (or must) call one."""
        return bool(self.tools) and self.tool_choice != "none"


class EmbeddingRequest(Body):
    """POST /v1/embeddings."""

    model_config = ConfigDict(extra="ignore")

    input: str | Annotated[list[str], Field(min_length=1, max_length=2048)] | Annotated[TokenIds, Field(min_length=1)] \
        | Annotated[list[Annotated[TokenIds, Field(min_length=1)]], Field(min_length=1, max_length=2048)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None  # OpenAI's truncation of the vector: not supported (any value is refused)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        return [self.input] if self.input and isinstance(self.input[0], int) else list(self.input)


class LlamaCompletionRequest(Sampling):
    """POST /completion, llama.cpp's native route and defaults (n_predict -1: until the context ends)."""

    prompt: str | TokenIds
    n_predict: Annotated[int, Field(ge=-1)] = -1
    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: TopP = DEFAULT_TOP_P
    stream: bool = False


class TokenizeRequest(Body):
    content: str
    add_special: bool = False


class DetokenizeRequest(Body):
    tokens: TokenIds
