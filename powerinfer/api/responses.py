"""OpenAI's Responses API (/v1/responses, as vLLM serves it) on top of chat completions: a request
becomes a `ChatRequest` (instructions and input items as messages, flat function tools as chat
tools, `text.format` as `response_format`), and the chat answer, whole or chunk by chunk, becomes a
Response object or its stream of events (response.created ... response.completed).

Nothing is stored: `store: true`, `previous_response_id` and the other server-side state are refused."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError

from powerinfer.api.schemas import (
    Body,
    ChatRequest,
    Name,
    OpenAIRequest,
    Temperature,
    TextPart,
    TopP,
    _unset,
    validation_message,
)
from powerinfer.errors import PowerInferError


class InputText(Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: Name
    arguments: str


class FunctionCallOutput(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class FunctionTool(Body):
    type: Literal["function"]
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChosenTool(Body):
    type: Literal["function"]
    name: Name


class TextFormat(Body):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Name = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: None = None


class ResponsesRequest(OpenAIRequest):
    """POST /v1/responses. Sampling fields as on the chat route; `n` is not OpenAI's here."""

    UNSUPPORTED: ClassVar[dict] = {
        "previous_response_id": _unset, "conversation": _unset, "prompt": _unset, "reasoning": _unset,
        "background": lambda v: v in (None, False), "include": lambda v: not v, "store": lambda v: v in (None, False),
        "truncation": lambda v: v in (None, "disabled"), "max_tool_calls": _unset, "prompt_cache_key": _unset,
        "safety_identifier": _unset, "service_tier": lambda v: v in (None, "auto", "default"),
        "top_logprobs": lambda v: not v,
    }

    input: str | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutput], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChosenTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None

    def chat_request(self) -> ChatRequest:
        """The same request as a chat completion (a bad combination is one line, as there)."""
        if self.choices > 1:
            raise PowerInferError("n: a response has one output (ask again for another)")
        # every field the chat route shares goes along (sampling, guided_*, response_format, ...)
        fields: dict[str, Any] = self.model_dump(include=set(OpenAIRequest.model_fields), by_alias=True, exclude_none=True)
        fields["parallel_tool_calls"] = self.parallel_tool_calls
        fields["messages"] = self._messages()
        fields["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else \
                {"type": "function", "function": {"name": self.tool_choice.name}}
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_schema":
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": form.name, "schema": form.schema_ or {}, "strict": form.strict}}
        elif form is not None:
            fields["response_format"] = {"type": form.type}
        if form is not None and self.response_format is not None:
            raise PowerInferError("text.format and response_format: give one")
        try:
            return ChatRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as error:
            raise PowerInferError(validation_message(error.errors())[0]) from None

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, InputMessage):
                content = item.content if isinstance(item.content, str) else \
                    [TextPart(type="text", text=part.text).model_dump() for part in item.content]
                messages.append({"role": item.role, "content": content})
            elif isinstance(item, FunctionCallItem):
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages


def _usage(chat_usage: dict) -> dict:
    return {"input_tokens": chat_usage["prompt_tokens"], "output_tokens": chat_usage["completion_tokens"],
            "total_tokens": chat_usage["total_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseShape:
    """One request's Response object, whole (`whole`) or as events (`start`, `events`, `finish`)."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model = request, model
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self.text = ""  # the message's text so far (streams)
        self.items: list[dict] = []  # output items so far (streams)
        self.finish_reason: str | None = None

    def _response(self, status: str, output: list[dict], usage: dict | None = None,
                  incomplete: bool = False) -> dict:
        r = self.request
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
                "output": output, "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "temperature": r.temperature, "top_p": r.top_p, "parallel_tool_calls": r.parallel_tool_calls is not False,
                "tool_choice": r.tool_choice.model_dump() if isinstance(r.tool_choice, ChosenTool) else r.tool_choice or "auto",
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
                "text": {"format": r.text.format.model_dump(by_alias=True, exclude_none=True)
                         if r.text is not None and r.text.format is not None else {"type": "text"}},
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
                "metadata": r.metadata or {}, "usage": usage}

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [self._part(text)]}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def _call(call: dict) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    # -- whole -----------------------------------------------------------------------------------

    def whole(self, chat_answer: dict) -> dict:
        choice = chat_answer["choices"][0]
        message = choice["message"]
        output = [self._call(c) for c in message.get("tool_calls") or []] or \
            [self._message(message["content"] or "", "completed")]
        incomplete = choice["finish_reason"] == "length"
        return self._response("incomplete" if incomplete else "completed", output, _usage(chat_answer["usage"]),
                              incomplete)

    # -- events ----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        opened = self._response("in_progress", [])
        return [self._event("response.created", response=opened), self._event("response.in_progress", response=opened)]

    def events(self, chunk: dict) -> list[dict]:
        """The events for one chat stream chunk."""
        out = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if not self.items:
                    self.items.append(self._message("", "in_progress"))
                    out += [self._event("response.output_item.added", output_index=0, item=self.items[0]),
                            self._event("response.content_part.added", item_id=self.message_id, output_index=0,
                                        content_index=0, part=self._part(""))]
                self.text += delta["content"]
                out.append(self._event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                       content_index=0, delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or []:
                item, index = self._call(call), len(self.items)
                self.items.append(item)
                out += [self._event("response.output_item.added", output_index=index,
                                    item={**item, "arguments": "", "status": "in_progress"}),
                        self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                    delta=item["arguments"]),
                        self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                    arguments=item["arguments"], name=item["name"]),
                        self._event("response.output_item.done", output_index=index, item=item)]
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self, chat_usage: dict) -> list[dict]:
        out = []
        if not self.items:  # an empty answer is still a message
            self.items.append(self._message("", "in_progress"))
            out.append(self._event("response.output_item.added", output_index=0, item=self.items[0]))
        if self.items[0]["type"] == "message":
            message = self._message(self.text, "completed")
            self.items[0] = message
            out += [self._event("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                                text=self.text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                                part=self._part(self.text)),
                    self._event("response.output_item.done", output_index=0, item=message)]
        incomplete = self.finish_reason == "length"
        final = self._response("incomplete" if incomplete else "completed", self.items, _usage(chat_usage), incomplete)
        return [*out, self._event("response.incomplete" if incomplete else "response.completed", response=final)]
