"""What OpenAI, vLLM and lm-evaluation-harness clients send to the server: vLLM's guided decoding
fields, /v1/completions' echo with logprobs, suffix; through the official openai client."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from test_server import assert_error, client, model_id, server  # noqa: F401 - the module's fixtures

CITY = {"type": "object", "additionalProperties": False, "required": ["name", "population"],
        "properties": {"name": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}


@pytest.mark.parametrize("chat", [False, True])
def test_vllm_guided_fields_constrain_the_answer(client, model_id, chat):  # noqa: F811
    def answer(max_tokens: int = 40, **guide) -> str:
        if chat:
            reply = client.chat.completions.create(model=model_id, max_tokens=max_tokens, temperature=0, extra_body=guide,
                                                   messages=[{"role": "user", "content": "Tell me about Paris."}])
            return reply.choices[0].message.content
        return client.completions.create(model=model_id, prompt="Paris is", max_tokens=max_tokens, temperature=0,
                                         extra_body=guide).choices[0].text

    assert answer(guided_choice=["big", "small", "old \"town\""]) in {"big", "small", "old \"town\""}
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", answer(guided_regex=r"[0-9]{3}-[a-z]{2}"))
    jsonschema.validate(json.loads(answer(100, guided_json=CITY)), CITY)
    jsonschema.validate(json.loads(answer(100, guided_json=json.dumps(CITY))), CITY)
    assert answer(guided_grammar='root ::= "yes" | "no"') in {"yes", "no"}  # llama.cpp's GBNF
    assert re.fullmatch(r"a+b", answer(guided_grammar='start: "a"+ "b"', guided_decoding_backend="xgrammar"))


@pytest.mark.parametrize("body, fragment", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "give one guided_* field at most"),
    ({"guided_regex": "[0-9"}, "grammar"),
    ({"guided_grammar": "??"}, "guided_grammar: not a Lark or GBNF grammar"),
    ({"guided_json": "{not json"}, "guided_json: not a JSON schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "use one or the other"),
    ({"guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern"),
])
def test_bad_guides_get_400(server, body, fragment):  # noqa: F811
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=60)
    assert fragment in assert_error(response, 400)["message"]


def test_guided_fields_through_the_python_api(default_llm):
    text = default_llm.create_completion("Paris is", max_tokens=8, temperature=0, guided_choice=["big", "small"])
    assert text["choices"][0]["text"] in {"big", "small"}
