"""JSON-schema constrained decoding for the engine (xgrammar): what llama.cpp's grammar gives on the CPU.

A small model asked for JSON on the GPU otherwise answers with a tool call of its own, leaves out a
required field, or writes past a length bound (docs/examples/gpu/README.md). Here a request carries a
matcher; at each step the engine masks every token the schema does not allow next. The matcher runs on
the host (microseconds per token); the mask is applied on the device inside the decode step.

xgrammar is optional: without it `Grammars.available()` is False and the server falls back to the
unenforced schema prefix (callers validate and retry, as with any endpoint).
"""
from __future__ import annotations

import json
from functools import lru_cache, partial


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class Grammars:
    """Compiles JSON schemas for one tokenizer (each schema once) and hands out a fresh matcher per request.

    A matcher duck-types what the engine calls: `fill_next_token_bitmask(mask, row)`, `accept_token(t)`."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # compact JSON: with any whitespace allowed, a small model at T > 0 can spend its budget on blanks
        compile_schema = partial(xgr.GrammarCompiler(info).compile_json_schema, any_whitespace=False)
        self._compile = lru_cache(maxsize=64)(compile_schema)

    def matcher(self, schema: dict):
        """A matcher for one reply in `schema`. Raises ValueError for a schema xgrammar cannot compile."""
        try:
            compiled = self._compile(json.dumps(schema))  # key order kept: the reply's fields come in it
        except Exception as err:  # xgrammar raises RuntimeError/ValueError from C++ for bad schemas
            raise ValueError(f"response_format: the JSON schema cannot be compiled to a grammar: {err}") from err
        return self._xgr.GrammarMatcher(compiled)


def request_schema(response_format: dict | None) -> dict | None:
    """The JSON schema in a request's `response_format`, in both forms: OpenAI's json_schema and
    llama.cpp's json_object + schema. None when the request asks for no particular shape."""
    rf = response_format or {}
    schema = rf.get("schema") or (rf.get("json_schema") or {}).get("schema")
    if schema:
        return schema if isinstance(schema, dict) else None
    return {"type": "object"} if rf.get("type") == "json_object" else None
