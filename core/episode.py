"""What a benchmark hands the agent: one episode (reset / step / score) and its small types.

Messages are OpenAI chat format throughout; an agent's action is one assistant turn
(text for the user, or tool calls), exactly what the model produced.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


def tool_arguments(raw: str | None) -> dict | None:
    """A tool call's JSON-encoded `arguments` as a dict (empty or missing: {}); None when the
    text is not a JSON object, so each caller reports a malformed call in its own terms."""
    try:
        args = json.loads(raw or "{}")
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


def decode_tool_calls(tool_calls: list[dict]) -> list[tuple[str, str, dict | None]]:
    """OpenAI tool calls -> (id, name, arguments); arguments is None when not a JSON object,
    so each adapter can report a malformed call in its own benchmark's terms."""
    return [(tc.get("id") or f"call_{uuid.uuid4().hex[:12]}", tc["function"]["name"],
             tool_arguments(tc["function"].get("arguments"))) for tc in tool_calls]


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what HF chat templates expect (tool-call arguments as dicts): every path
    that renders a chat template (transformers here, llama.cpp's server in core/server.py) gives
    the model its own earlier calls as JSON objects, not as quoted strings."""
    def as_dict(fn: dict) -> dict:  # a malformed call keeps its text
        args = tool_arguments(fn["arguments"]) if isinstance(fn.get("arguments"), str) else None
        return dict(fn) if args is None else {**fn, "arguments": args}

    out = [dict(m) for m in messages]
    for m in out:
        if m.get("tool_calls"):
            m["tool_calls"] = [{**tc, "function": as_dict(tc["function"])} for tc in m["tool_calls"]]
            m["content"] = m.get("content") or ""
    return out


@dataclass
class Task:
    id: str
    benchmark: str
    split: str
    description: str = ""  # a short text for the analyst; never shown to the agent


@dataclass
class Observation:
    messages: list[dict]  # OpenAI-format messages to append (tool results, user turns)
    done: bool = False
    reason: str | None = None  # why the episode ended, when done


@dataclass
class Score:
    reward: float
    passed: bool
    reasons: dict[str, Any] = field(default_factory=dict)


class Episode(ABC):
    """One attempt at one task. The agent sees `system_prompt` and `tools` only."""

    system_prompt: str
    tools: list[dict]  # OpenAI function-tool schemas
    max_steps: int = 30
    plain_system_prompt: str | None = None  # a hinted episode's prompt without the hint (GRPO's loss conditions on it)

    @abstractmethod
    def reset(self) -> Observation:
        """Start the task; the observation holds the first messages after the system prompt."""

    @abstractmethod
    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        """Apply one assistant turn: `tool_calls` in OpenAI format, or `content` for the user."""

    @abstractmethod
    def score(self, termination: str) -> Score:
        """Score the finished episode. `termination` is the reason it ended."""

    def close(self) -> None:
        pass
