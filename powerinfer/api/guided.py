"""vLLM's guided decoding fields, mapped onto our constrained decoding (llguidance grammars):
`guided_json` (a schema, as a dict or JSON text), `guided_regex`, `guided_choice` (one of the
strings) and `guided_grammar` (Lark, or llama.cpp's GBNF)."""

from __future__ import annotations

import json
from typing import Any

from llguidance.gbnf_to_lark import any_to_lark

from powerinfer.errors import PowerInferError
from powerinfer.runtime.constraint import json_schema_grammar, lark_grammar, regex_grammar


def guided_grammar(field: str, value: Any) -> str:
    """The grammar one guided field asks for."""
    if field == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise PowerInferError(f"guided_json: not a JSON schema ({error})") from None
        if not isinstance(value, dict):
            raise PowerInferError("guided_json: a JSON schema is an object")
        return json_schema_grammar(value)
    if field == "guided_regex":
        try:
            return regex_grammar(value)
        except (ValueError, RuntimeError) as error:
            raise PowerInferError(f"guided_regex: not a usable regex ({' '.join(str(error).split())})") from None
    if field == "guided_choice":
        # Lark string literals escape as JSON strings do
        return lark_grammar("start: " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in value))
    try:
        return lark_grammar(any_to_lark(value))
    except Exception as error:  # noqa: BLE001 - the converter's own error types vary; the grammar is the user's
        raise PowerInferError(f"guided_grammar: not a Lark or GBNF grammar ({' '.join(str(error).split())})") from None
