"""Tool calling: tools shown to the model, its answer held to a tool-call grammar, and parsed back.

A chat template that knows tools (it uses the `tools` variable) renders them itself. For the
others, a system message lists the functions (`fallback_instructions`). Either way the answer is
constrained to a call, one JSON object `{"name": ..., "arguments": {...}}` with the arguments
valid against the function's parameters; templates that wrap calls in `<tool_call>` tags
(Hermes, Qwen) get the tags around it. With tool_choice "auto" the answer is either such a call
or plain text that does not start like one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from powerinfer.api.schemas import ChatRequest, Message, NamedToolChoice
from powerinfer.runtime.constraint import JSON_STYLE, lark_grammar

OPEN_TAG, CLOSE_TAG = "<tool_call>\n", "\n</tool_call>"


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


@dataclass(frozen=True)
class ToolFormat:
    """How calls are written for this request: the functions allowed, and the tags around a call."""

    names: tuple[str, ...]
    prefix: str = ""
    suffix: str = ""

    def parse(self, text: str) -> dict[str, Any] | None:
        """The call in `text` as an OpenAI tool_calls entry, or None when it is not a call."""
        body = text.strip()
        if self.prefix:
            if not body.startswith(self.prefix.strip()) or not body.endswith(self.suffix.strip()):
                return None
            body = body[len(self.prefix.strip()) : len(body) - len(self.suffix.strip())]
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
            return None
        if not isinstance(call, dict) or call.get("name") not in self.names or not isinstance(call.get("arguments"), dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def tool_format(request: ChatRequest, template: str | None) -> ToolFormat | None:
    """The format of calls for `request` (None when it offers no tool to call)."""
    if not request.calls_tools:
        return None
    chosen = request.tool_choice
    names = (chosen.function.name,) if isinstance(chosen, NamedToolChoice) else tuple(
        t.function.name for t in request.tools or [])
    tagged = template_knows_tools(template) and OPEN_TAG.strip() in (template or "")
    return ToolFormat(names, *((OPEN_TAG, CLOSE_TAG) if tagged else ("", "")))


def tool_grammar(request: ChatRequest, fmt: ToolFormat) -> str:
    """The grammar the answer must follow: a call ("required" or a named function), or with
    "auto" a call or text that does not begin like one."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or {"type": "object"}}}
             for t in request.tools or [] if t.function.name in fmt.names]
    schema = json.dumps({"anyOf": calls, "x-guidance": JSON_STYLE})
    call = " ".join(part for part in (json.dumps(fmt.prefix) if fmt.prefix else "", "body",
                                      json.dumps(fmt.suffix) if fmt.suffix else "") if part)
    rules = [f"call: {call}", f"body: %json {schema}"]
    if request.tool_choice in (None, "auto"):
        first = json.dumps((fmt.prefix or "{")[0])[1:-1].replace("]", "\\]").replace("-", "\\-")
        rules = ["start: call | TEXT", *rules, f"TEXT: /[^{first}](.|\\n)*/"]
    else:
        rules = ["start: call", *rules]
    return lark_grammar("\n".join(rules) + "\n")


def fallback_instructions(request: ChatRequest) -> str:
    """The system message that presents the tools to a model whose template cannot."""
    functions = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                      "parameters": t.function.parameters or {"type": "object"}}, ensure_ascii=False)
                          for t in request.tools or [])
    return ("You can call these functions:\n" + functions + "\nTo call one, reply with only a JSON object: "
            '{"name": <function name>, "arguments": <the arguments as a JSON object>}.')


def template_messages(request: ChatRequest, template: str | None) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The conversation as the chat template takes it, and the tools for its `tools` variable
    (None when the template does not render tools, or none may be called)."""
    knows = template_knows_tools(template)
    messages = [_template_message(m, knows) for m in request.messages]
    if not request.calls_tools:
        return messages, None
    if knows:
        return messages, [t.model_dump(exclude_none=True) for t in request.tools or []]
    note = fallback_instructions(request)
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{note}"}
    else:
        messages.insert(0, {"role": "system", "content": note})
    return messages, None


def _template_message(message: Message, knows_tools: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in message.tool_calls]
        if knows_tools:  # templates read the arguments as a mapping (transformers' convention)
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                 for c, call in zip(message.tool_calls, calls)]
        else:  # the call as the model was asked to write it
            out["content"] = (out["content"] + "\n" if out["content"] else "") + "\n".join(
                json.dumps(call, ensure_ascii=False) for call in calls)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes: kept as text
        return text
