"""A scripted agent: a model stand-in that answers from a script, for a benchmark plugin's own tests (a gold
agent that must score full marks, an empty one that must score its floor) and for trace-rl's tests.

    from trace_rl.models.scripted import ScriptedLLM, ToolCall
    gold = ScriptedLLM(lambda messages, tools: ToolCall("get_user", {"user_id": "u1"})
                       if messages[-1]["role"] == "user" else "Paris")
    rollout(bench, gold, task_ids, TrajectoryStore(tmp_dir))
"""
from __future__ import annotations

from typing import Callable

from trace_rl.models.chat import Reply, ToolCall
from trace_rl.models.llm import LLM, LLMConfig

__all__ = ["ScriptedLLM", "ToolCall", "Reply"]


class ScriptedLLM(LLM):
    """Answers from a script: a list of replies, or a function of (messages, tools) returning one. A reply is
    text (for the user), a `ToolCall(name, arguments)` or a whole `Reply`. `requests` keeps what it was asked."""

    def __init__(self, script: list | Callable[[list[dict], list | None], object], name: str = "scripted"):
        super().__init__(LLMConfig(model=name))
        self.script = script
        self.requests: list[list[dict]] = []

    def _complete(self, messages, tools, **kw) -> Reply:
        self.requests.append(list(messages))
        out = self.script(messages, tools) if callable(self.script) else self.script.pop(0)
        if isinstance(out, Reply):
            return out
        if isinstance(out, ToolCall):
            return Reply(content="", tool_calls=[out], prompt_tokens=10, completion_tokens=5)
        return Reply(content=str(out), tool_calls=[], prompt_tokens=10, completion_tokens=5)
