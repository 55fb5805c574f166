"""The benchmark adapter protocol: what trace-rl needs from any agent benchmark.

A new benchmark is one file: subclass `Benchmark` (tasks + splits) and `Episode`
(reset / step / score), then `register("name", factory)`. See docs/benchmarks.md.
Messages are OpenAI chat format throughout; an agent's action is one assistant turn
(text for the user, or tool calls), exactly what the model produced.
"""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable


def decode_tool_calls(tool_calls: list[dict]) -> list[tuple[str, str, dict | None]]:
    """OpenAI tool calls -> (id, name, arguments); arguments is None when not a JSON object,
    so each adapter can report a malformed call in its own benchmark's terms."""
    out = []
    for tc in tool_calls:
        fn = tc["function"]
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = None
        out.append((tc.get("id") or f"call_{uuid.uuid4().hex[:12]}", fn["name"], args if isinstance(args, dict) else None))
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


class Benchmark(ABC):
    name: str

    @abstractmethod
    def splits(self) -> list[str]: ...

    @abstractmethod
    def tasks(self, split: str) -> list[Task]: ...

    @abstractmethod
    def episode(self, task_id: str) -> Episode: ...

    def spec(self) -> dict:
        """What a synthesized environment must imitate: {"tools", "policy", "system_prompt"}.
        The default reads one episode of the first split; adapters may answer more cheaply."""
        ep = self.episode(self.tasks(self.splits()[0])[0].id)
        try:
            ep.reset()
            return {"tools": ep.tools, "policy": ep.system_prompt, "system_prompt": ep.system_prompt}
        finally:
            ep.close()

    def task(self, task_id: str, split: str | None = None) -> Task:
        for s in [split] if split else self.splits():
            for t in self.tasks(s):
                if t.id == task_id:
                    return t
        raise BenchmarkError(f"{self.name}: unknown task id {task_id!r}"
                             + (f" in split {split!r}" if split else ""))


class BenchmarkError(ValueError):
    pass


_REGISTRY: dict[str, Callable[..., Benchmark]] = {}


def register(prefix: str, factory: Callable[..., Benchmark]) -> None:
    _REGISTRY[prefix] = factory


def load_benchmark(spec: str, **options) -> Benchmark:
    """`tau2:telecom` -> the adapter registered for `tau2` with variant `telecom`."""
    from trace_rl.evals import tau2_bench  # noqa: F401  (registers itself)

    prefix, _, variant = spec.partition(":")
    if prefix not in _REGISTRY:
        raise BenchmarkError(f"unknown benchmark {spec!r}; known: {', '.join(sorted(_REGISTRY))} "
                             "(write one with trace_rl.evals.benchmark.register)")
    return _REGISTRY[prefix](variant, **options)
