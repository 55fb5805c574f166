"""What a benchmark hands the agent: one episode (reset / step / score) and its small types.

Messages are OpenAI chat format throughout; an agent's action is one assistant turn
(text for the user, or tool calls), exactly what the model produced.
"""
from __future__ import annotations

import json
import math
import threading
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable


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
    that renders a chat template (transformers here, llama.cpp's server in models/llama_server.py) gives
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

    system_prompt: str | None  # None: the benchmark has no system prompt, and no system message is sent
    tools: list[dict]  # OpenAI function-tool schemas
    max_steps: int = 30
    text_tool_calls: bool = True  # False: only calls in the model's own format count; JSON in prose stays prose
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


STEP_TIMEOUT_S = 600.0  # a sane default for one reset/step/score call: a user simulator on a CPU may take a minute


def opening(system_prompt: str | None, messages: list[dict]) -> list[dict]:
    """The conversation as the model is shown it: the system message (none where the benchmark declares no
    system prompt), then `messages`."""
    return ([] if system_prompt is None else [{"role": "system", "content": system_prompt}]) + list(messages)


class EpisodeFault(Exception):
    """A benchmark's episode misbehaved at its boundary: `termination` is env_error (it raised, SystemExit
    included, or returned the wrong type) or env_timeout (a call outlasted its deadline)."""

    def __init__(self, termination: str, message: str):
        super().__init__(message)
        self.termination = termination


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
        raise EpisodeFault("env_error", f"{where} returned messages that are not a list of {{'role': ...}} dicts: "
                                        f"{value!r:.120}")
    return value


def _is_episode(obj) -> bool:
    """An Episode, or an object shaped like one (the protocol is duck-typed: reset, step, score)."""
    return isinstance(obj, Episode) or all(callable(getattr(obj, m, None)) for m in ("reset", "step", "score"))


class Guarded(Episode):
    """Any episode behind the plugin boundary: every call runs under a deadline (a hung one ends as
    env_timeout; its thread is abandoned, daemonic), an exception of any kind (SystemExit too) or a value of
    the wrong type ends as env_error, and a score must be a finite reward with a bool `passed`. The rollout
    loop and GRPO both play benchmarks through it, so a plugin cannot crash, hang or poison either."""

    def __init__(self, inner: "Episode | Callable[[], Episode]", timeout_s: float = STEP_TIMEOUT_S):
        """`inner`: the episode, or a function that makes it (a benchmark's `episode(task_id)`), which then
        runs behind the same boundary at reset."""
        self.inner, self.timeout_s = inner, timeout_s

    # what the agent sees, read from the plugin after reset and checked there
    system_prompt = property(lambda self: self.inner.system_prompt)
    tools = property(lambda self: self.inner.tools)
    max_steps = property(lambda self: self.inner.max_steps)
    plain_system_prompt = property(lambda self: self.inner.plain_system_prompt)
    text_tool_calls = property(lambda self: getattr(self.inner, "text_tool_calls", True))

    def _call(self, what: str, fn, *args, timeout: float | None = None):
        box: dict = {}

        def target():
            try:
                box["value"] = fn(*args)
            except BaseException as err:  # SystemExit, a plugin's own BaseException: all recorded
                box["error"] = err

        worker = threading.Thread(target=target, name=f"episode-{what}", daemon=True)
        worker.start()
        worker.join(self.timeout_s if timeout is None else timeout)
        if worker.is_alive():
            raise EpisodeFault("env_timeout", f"{what}() did not return within {self.timeout_s:g} s")
        if "error" in box:
            err = box["error"]
            if isinstance(err, EpisodeFault):
                raise err
            raise EpisodeFault("env_error", f"{what}() raised {type(err).__name__}: {str(err)[:1500]}")
        return box["value"]

    def _observation(self, obs, what: str) -> Observation:
        if not isinstance(obs, Observation):
            raise EpisodeFault("env_error", f"{what}() returned {type(obs).__name__}, not an Observation")
        if obs.reason is not None and not isinstance(obs.reason, str):
            raise EpisodeFault("env_error", f"{what}() returned a reason of type {type(obs.reason).__name__}")
        return Observation(_messages(obs.messages, f"{what}()"), bool(obs.done), obs.reason)

    def reset(self) -> Observation:
        if not _is_episode(self.inner):
            made = self._call("episode", self.inner)
            if not _is_episode(made):
                raise EpisodeFault("env_error", f"episode() returned {type(made).__name__}, not an Episode")
            self.inner = made
        obs = self._observation(self._call("reset", self.inner.reset), "reset")
        prompt, tools, steps = (getattr(self.inner, a, None) for a in ("system_prompt", "tools", "max_steps"))
        if prompt is not None and not isinstance(prompt, str):
            raise EpisodeFault("env_error", f"system_prompt is {type(prompt).__name__}, not a str (or None: no system prompt)")
        if not isinstance(self.text_tool_calls, bool):
            raise EpisodeFault("env_error", f"text_tool_calls is {type(self.text_tool_calls).__name__}, not a bool")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise EpisodeFault("env_error", f"tools is {type(tools).__name__}, not a list of tool-schema dicts")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise EpisodeFault("env_error", f"max_steps is {steps!r}, not a positive int")
        return obs

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        return self._observation(self._call("step", self.inner.step, content, tool_calls), "step")

    def score(self, termination: str) -> Score:
        score = self._call("score", self.inner.score, termination)
        if not isinstance(score, Score):
            raise EpisodeFault("env_error", f"score() returned {type(score).__name__}, not a Score")
        reward = score.reward
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EpisodeFault("env_error", f"score() returned reward {reward!r:.60}: a finite number is required")
        if not isinstance(score.passed, bool):
            raise EpisodeFault("env_error", f"score() returned passed={score.passed!r:.60}: a bool is required")
        if not isinstance(score.reasons, dict):
            raise EpisodeFault("env_error", f"score() returned reasons of type {type(score.reasons).__name__}")
        return Score(float(reward), score.passed, score.reasons)

    def close(self) -> None:
        if not _is_episode(self.inner):
            return  # never made
        try:
            self._call("close", self.inner.close, timeout=min(self.timeout_s, 30.0))
        except EpisodeFault:
            pass  # closing cannot change a recorded episode; a worker's process tree is ended by its owner
