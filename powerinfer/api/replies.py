"""Answers in OpenAI's shapes (text completions and chat completions, whole or as stream chunks),
built once for the HTTP server and the Python API (`LLM.create_completion` and friends)."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np

from powerinfer.api.prepare import Prepared
from powerinfer.runtime.scheduler import Event
from powerinfer.runtime.sequence import Completion, TokenLogprob
from powerinfer.runtime.token_bytes import token_bytes
from powerinfer.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # what OpenAI reports for a token of probability (almost) 0


def usage(completions: list[Completion]) -> dict:
    """Token counts of a request: its prompt once, the generated tokens of every choice."""
    prompt = completions[0].prompt_tokens if completions else 0
    generated = sum(len(c.tokens) for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def joined(replies: list[OpenAIReply]) -> list[OpenAIReply]:
    """A batch's replies, answering as one: one id and creation time."""
    for reply in replies[1:]:
        reply.id, reply.created = replies[0].id, replies[0].created
    return replies


def merged(answers: list[dict]) -> dict:
    """A batch's whole answers as one: every choice, the usage added up."""
    usages = [a["usage"] for a in answers]
    return {**answers[0], "choices": [c for a in answers for c in a["choices"]],
            "usage": {key: sum(u[key] for u in usages) for key in usages[0]}}


def merged_usage_chunk(replies: list[OpenAIReply]) -> dict:
    chunks = [r.usage_chunk() for r in replies]
    return {**chunks[0], "usage": {key: sum(c["usage"][key] for c in chunks) for key in chunks[0]["usage"]}}


def best(completions: list[Completion], keep: int) -> list[Completion]:
    """best_of: the `keep` completions of highest log probability per token, as OpenAI ranks them
    (their order among themselves kept)."""
    def mean_logprob(completion: Completion) -> float:
        entries = completion.logprobs or []
        return sum(e.logprob for e in entries) / len(entries) if entries else 0.0

    ranked = sorted(range(len(completions)), key=lambda i: -mean_logprob(completions[i]))[:keep]
    return [completions[i] for i in sorted(ranked)]


class OpenAIReply:
    """One request's answer: `whole(completions)`, or `opening()`, `chunks(event)` per event and
    `usage_chunk()` for a stream."""

    def __init__(self, model: str, tokenizer: Tokenizer, prepared: Prepared, chat: bool):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.model, self.tokenizer, self.chat = model, tokenizer, chat
        self.logprobs, self.tools = prepared.logprobs, prepared.tools
        self.echo, self.keep, self.first_index = prepared.echo, prepared.keep, prepared.first_index
        self.echoed: set[int] = set()  # choices whose stream already carried the prompt
        self.n = len(prepared.sequences)
        self.created = int(time.time())
        self.text_offsets = [0] * self.n  # where the next token's text starts, per choice (completions)
        self.held = [""] * self.n  # text held back until a tool call can be told from an answer
        self.finished: dict[int, Completion] = {}

    # -- whole answers ---------------------------------------------------------------------------

    def whole(self, completions: list[Completion]) -> dict:
        answered = completions if self.keep is None else best(completions, self.keep)
        choices = [self._whole_choice(i, c) for i, c in enumerate(answered)]
        return {**self._envelope(self.object, choices), "usage": usage(completions)}

    def _whole_choice(self, index: int, completion: Completion) -> dict:
        if not self.chat:
            text, logprobs = self._echoed(index, completion.text, completion.logprobs or [])
            return {"index": self.first_index + index, "text": text, "logprobs": logprobs,
                    "finish_reason": completion.finish_reason}
        logprobs = self._logprobs(index, completion.logprobs or []) if self.logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": completion.text}
        finish = completion.finish_reason
        call = self.tools.parse(completion.text) if self.tools is not None else None
        if call is not None:
            message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    # -- streams ---------------------------------------------------------------------------------

    def opening(self) -> list[dict]:
        """Chat streams start with the assistant's role, once per choice."""
        if not self.chat:
            return []
        return [self._envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}])
                for i in range(self.n)]

    def chunks(self, event: Event) -> list[dict]:
        """The chunks for one event of the scheduler (an error event is the caller's to report)."""
        i, text = event.index, event.text
        if self.echo is not None and i not in self.echoed:
            self.echoed.add(i)
            text, logprobs = self._echoed(i, text, event.logprobs or [])
        else:
            logprobs = self._logprobs(i, event.logprobs) if self.logprobs and event.logprobs else None
        out = []
        if self.tools is not None:  # a call is only known once complete: its text comes at the end
            self.held[i] += text
            text = ""
        if text or logprobs:
            out.append(self._chunk(i, {"content": text} if self.chat else text, logprobs, None))
        if event.completion is not None:
            self.finished[i] = event.completion
            out += self._closing(i, event.completion)
        return out

    def _closing(self, index: int, completion: Completion) -> list[dict]:
        finish, out = completion.finish_reason, []
        if self.tools is not None:
            call = self.tools.parse(self.held[index])
            if call is not None:
                delta, finish = {"tool_calls": [{"index": 0, **call}]}, "tool_calls"
            else:
                delta = {"content": self.held[index]}
            out.append(self._chunk(index, delta, None, None))
        out.append(self._chunk(index, {} if self.chat else "", None, finish))
        return out

    def usage_chunk(self) -> dict:
        return {**self._envelope(self.chunk_object, []), "usage": usage([self.finished[i] for i in sorted(self.finished)])}

    def _chunk(self, index: int, content: dict | str, logprobs: dict | None, finish: str | None) -> dict:
        field = "delta" if self.chat else "text"
        return self._envelope(self.chunk_object, [{"index": self.first_index + index, field: content,
                                                   "logprobs": logprobs, "finish_reason": finish}])

    def _envelope(self, object: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices}

    # -- logprobs --------------------------------------------------------------------------------

    def _token(self, token: int) -> tuple[str, bytes]:
        """A token's text and bytes; a token holding part of a character is written as its bytes,
        "bytes:\\xe6\\x97", as OpenAI does."""
        raw = token_bytes(self.tokenizer)[token]
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _echoed(self, index: int, text: str, entries: list[TokenLogprob]) -> tuple[str, dict | None]:
        """A completion's text and logprobs, after the prompt's when it is echoed."""
        if self.echo is None:
            return text, self._logprobs(index, entries) if self.logprobs else None
        prompt = self.echo.logprobs or [None] * len(self.echo.ids)
        scored = [*prompt, *entries] if self.echo.logprobs is not None else entries
        return self.echo.text + text, self._logprobs(index, scored, self.echo.ids) if self.logprobs else None

    def _logprobs(self, index: int, entries: list[TokenLogprob | None], ids: list[int] = ()) -> dict:
        """OpenAI's logprobs of `entries`; an entry of None (an echoed prompt's first token) is
        token `ids[i]` with null logprobs."""
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries], "refusal": None}
        tokens, offsets = [], []
        for i, entry in enumerate(entries):
            text, raw = self._token(entry.token if entry is not None else ids[i])
            tokens.append(text)
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(raw.decode("utf-8", errors="ignore"))
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else max(e.logprob, MIN_LOGPROB) for e in entries],
                "top_logprobs": [None if e is None else {self._token(t)[0]: max(lp, MIN_LOGPROB) for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def _chat_logprob(self, entry: TokenLogprob) -> dict:
        def one(token: int, logprob: float) -> dict:
            text, raw = self._token(token)
            return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw)}

        return {**one(entry.token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def embedding_list(vectors: list[list[float]], n_tokens: int, model: str,
                   encoding: Literal["float", "base64"] = "float") -> dict:
    """OpenAI's embeddings answer; base64 is the float32 little-endian bytes, as OpenAI sends them."""
    def encode(vector: list[float]) -> list[float] | str:
        return vector if encoding == "float" else base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
