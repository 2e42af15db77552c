"""Request bodies the server accepts, validated by pydantic (a failure becomes a 400 answer).

Unknown fields are ignored (clients send many optional ones). Ranges are checked here, before a
request reaches the scheduler: a value the sampler cannot use must be refused, not fail later.
Text must be valid Unicode: JSON can spell a lone surrogate ("\\ud800"), which no tokenizer takes.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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
TokenIds = list[Annotated[int, Field(ge=0, lt=2**31)]]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


def _check_unicode(value: Any) -> None:
    """Refuse strings holding UTF-16 surrogates, anywhere in the JSON value."""
    if isinstance(value, str):
        if SURROGATE.search(value):
            raise ValueError("text holds a lone UTF-16 surrogate (not valid Unicode)")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)


class Sampling(Body):
    """Sampling fields shared by every generation route (top_k, min_p, repeat_penalty as in llama.cpp)."""

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 40
    min_p: MinP = 0.05
    repeat_penalty: RepeatPenalty = 1.0
    repeat_last_n: Annotated[int, Field(ge=0)] = 64
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
                    repeat_penalty=self.repeat_penalty, repeat_last_n=self.repeat_last_n, seed=seed)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class StreamOptions(Body):
    include_usage: bool = False


class OpenAIRequest(Sampling):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    n: Literal[1] | None = 1  # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(OpenAIRequest):
    """POST /v1/completions. A prompt is text or token ids (a batch of one is accepted too)."""

    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)]

    def single_prompt(self) -> str | list[int]:
        batch = isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], str | list)
        return self.prompt[0] if batch else self.prompt


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None


class LlamaCompletionRequest(Sampling):
    """POST /completion, llama.cpp's native route and defaults (n_predict -1: until the context ends)."""

    prompt: str | TokenIds
    n_predict: Annotated[int, Field(ge=-1)] = -1
    temperature: Temperature = 0.8
    top_p: TopP = 0.95
    stream: bool = False


class TokenizeRequest(Body):
    content: str
    add_special: bool = False


class DetokenizeRequest(Body):
    tokens: TokenIds
