"""What a chat model answers and how its text is read: tool calls, replies, token usage, JSON found
in a reply, and the endpoint errors that have a meaning (a too-long prompt, a refused response format).
Shared by the client (models/llm.py), the engine's policy and its server, and GRPO."""
from __future__ import annotations

import json
import re
import uuid
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from trace_rl.core.episode import tool_arguments


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass
class Reply:
    content: str
    tool_calls: list[ToolCall]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    tool_calls_from_text: bool = False  # parsed out of plain text rather than `tool_calls`

    def to_message(self) -> dict:
        # content is "" rather than None with tool calls: llama.cpp's server rejects None.
        msg: dict[str, Any] = {"role": "assistant", "content": "" if self.tool_calls else self.content}
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
        return msg


@dataclass
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    cost_usd: float = 0.0

    def add(self, reply: Reply, cost: float) -> None:
        self.calls += 1
        self.prompt_tokens += reply.prompt_tokens
        self.completion_tokens += reply.completion_tokens
        self.seconds += reply.seconds
        self.cost_usd += cost


class ReplyError(Exception):
    """A model gave no usable answer; `reply` is its last raw answer, kept for the record."""

    def __init__(self, message: str, reply: str = ""):
        super().__init__(message)
        self.reply = reply


class RequestDeadlineError(TimeoutError):
    """An endpoint kept a request past its deadline (it hung, or dripped its answer)."""


class StructuredOutputError(ReplyError, RuntimeError):
    """No valid answer after the retries."""


# ---------------------------------------------------------------- endpoint errors (openai client's types)
# Text the endpoints put in a context-overflow 400 when they set no error code: vLLM ("This
# model's maximum context length is ..."), older llama.cpp and other OpenAI-compatible servers.
_CONTEXT_WORDING = ("context length", "context_length", "maximum context", "too many tokens", "exceeds the context",
                    "n_ctx")


def is_context_length_error(err: BaseException) -> bool:
    """The endpoint refused the request as longer than the model's context window: a 400 from
    the openai client with code `context_length_exceeded` (OpenAI, llama-cpp-python's server),
    or one whose message is the only signal (vLLM sends no code), checked for the wording."""
    import openai

    if not isinstance(err, openai.BadRequestError):
        return False
    return err.code == "context_length_exceeded" or any(s in err.message.lower() for s in _CONTEXT_WORDING)


def is_response_format_rejected(err: BaseException) -> bool:
    """The endpoint may have refused the request's `response_format`: any 400 from the openai client
    (its reason is not told apart: retrying without the format is cheap), or another status whose
    message names `response_format` (a server validating the request body answers 422, one failing
    to build the grammar 500): there the text is the only signal."""
    import openai

    return isinstance(err, openai.BadRequestError) or \
        isinstance(err, openai.APIStatusError) and "response_format" in err.message


# ---------------------------------------------------------------- tool calls in text
_FENCE = re.compile(r"```(?:json|tool_call)?\s*(.*?)```", re.S)
_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _json_objects(text: str):
    """Every top-level JSON object in `text`, in order (each object of a list on its own)."""
    dec = json.JSONDecoder()
    i = 0
    while (i := text.find("{", i)) != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i += 1
            continue
        yield obj
        i = end


def _as_tool_call(obj: dict, names: set[str] | None) -> ToolCall | None:
    if isinstance(obj.get("function"), dict):  # OpenAI-shaped
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = tool_arguments(args.strip())
    if not isinstance(name, str) or not isinstance(args, dict) or (names is not None and name not in names):
        return None
    return ToolCall(name=name, arguments=args)


def parse_tool_calls(text: str, names: set[str] | None = None, loose: bool = True) -> list[ToolCall]:
    """Tool calls written as text: <tool_call> tags, ```json fences, or bare JSON objects.

    Small models often answer a tool-use turn with JSON in the message body instead of
    a `tool_calls` entry; `names` (the offered tools) keeps prose JSON from matching. `loose=False`
    (a benchmark that turns text calls off): only <tool_call> tags, the chat template's own format.
    """
    if not text or "{" not in text:
        return []
    chunks = _TAG.findall(text) or (_FENCE.findall(text) or [text] if loose else [])
    return [tc for chunk in chunks for obj in _json_objects(chunk) if (tc := _as_tool_call(obj, names))]


def quote_inner_quotes(text: str) -> str:
    """A small model's JSON with quotes inside a string ("calls "enable_roaming" twice") or raw
    newlines in one, made parseable: inside a string, a quote closes it only when a `,` `:` `}` `]`
    or the end follows; any other is escaped. Used only after a strict parse failed."""
    out, in_str, i, n = [], False, 0, len(text)
    while i < n:
        c = text[i]
        if in_str and c == "\\" and i + 1 < n:
            out.append(text[i:i + 2])
            i += 2
            continue
        if c == '"':
            if not in_str:
                in_str = True
            else:
                rest = text[i + 1:].lstrip()
                if not rest or rest[0] in ",:}]":
                    in_str = False
                else:
                    c = '\\"'
        elif in_str and c in "\n\r\t":
            c = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]
        out.append(c)
        i += 1
    return "".join(out)


def extract_json(text: str) -> Any:
    """The first JSON value in a reply (fenced or bare), strict first, then with inner quotes
    escaped (endpoints without a grammar) and other raw control characters in strings allowed (xgrammar's
    JSON grammar lets a tab through); raises ValueError if none."""
    for fix in (str, quote_inner_quotes):
        strict = fix is str
        for chunk in _FENCE.findall(text) + [text]:
            chunk = fix(chunk.strip())
            with suppress(ValueError):
                return json.loads(chunk, strict=strict)
            for start in (chunk.find("{"), chunk.find("[")):
                if start != -1:
                    with suppress(ValueError):
                        return json.JSONDecoder(strict=strict).raw_decode(chunk, start)[0]
    raise ValueError("no JSON value found in the reply")
