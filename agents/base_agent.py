"""The base agent: a tool-calling loop against any benchmark episode.

Every way an episode can end is an explicit `termination` in the trajectory
(agent_stop, user_stop, max_steps, context_length, llm_error, env_error, ...), never a crash.
"""
from __future__ import annotations

import re
import time
from typing import Any, Protocol

from trace_rl.core.episode import Episode, Score
from trace_rl.core.llm import is_context_length_error
from trace_rl.core.trajectory import Trajectory


class Policy(Protocol):
    """What the loop needs from a model: `LLM` (any endpoint) or a local transformers policy."""

    name: str

    def chat(self, messages: list[dict], tools: list[dict] | None = None, **kw) -> Any: ...


def _error_kind(error: str) -> str | None:
    """The sandbox's error kind ("[timeout] ...") when the error came from a session."""
    m = re.search(r"\[(timeout|crashed|oom|protocol|output_limit|env_error|episode_timeout|contract)\]", error)
    return m.group(1) if m else None


def run_episode(policy: Policy, episode: Episode, *, task_id: str, benchmark: str, trial: int = 0,
                split: str = "", max_steps: int | None = None, **chat_kw) -> Trajectory:
    """Roll out one episode to the end and score it."""
    t0 = time.perf_counter()
    started = time.time()
    max_steps = max_steps or episode.max_steps
    stats = dict(steps=0, tool_calls=0, malformed_tool_calls=0, text_tool_calls=0, prompt_tokens=0,
                 completion_tokens=0)
    error = None
    try:
        obs = episode.reset()
    except Exception as err:  # e.g. the user simulator failed on its first turn
        try:
            episode.close()
        except Exception:
            pass
        text = f"{type(err).__name__}: {err}"[:2000]
        return Trajectory(task_id=task_id, benchmark=benchmark, trial=trial, model=policy.name,
                          messages=[], reward=0.0, passed=False, termination="env_error",
                          reasons={"error": text, **({"error_kind": k} if (k := _error_kind(text)) else {})},
                          seconds=time.perf_counter() - t0,
                          started_at=started, split=split, **stats)
    messages = [{"role": "system", "content": episode.system_prompt}, *obs.messages]
    termination = obs.reason if obs.done else None
    while termination is None:
        if stats["steps"] >= max_steps:
            termination = "max_steps"
            break
        try:
            reply = policy.chat(messages, tools=episode.tools, **chat_kw)
        except Exception as err:  # endpoint failures end the episode, recorded
            termination = "context_length" if is_context_length_error(err) else "llm_error"
            error = f"{type(err).__name__}: {err}"[:2000]
            break
        stats["steps"] += 1
        stats["prompt_tokens"] += reply.prompt_tokens
        stats["completion_tokens"] += reply.completion_tokens
        stats["tool_calls"] += len(reply.tool_calls)
        stats["malformed_tool_calls"] += sum("__malformed__" in tc.arguments for tc in reply.tool_calls)
        stats["text_tool_calls"] += len(reply.tool_calls) if reply.tool_calls_from_text else 0
        msg = reply.to_message()  # one turn is either text or tool calls (tau2's rule)
        messages.append(msg)
        try:
            obs = episode.step(msg.get("content") or "", msg.get("tool_calls") or [])
        except Exception as err:  # the environment or its user simulator failed: recorded, not raised
            termination, error = "env_error", f"{type(err).__name__}: {err}"[:2000]
            break
        messages.extend(obs.messages)
        if obs.done:
            termination = obs.reason or "agent_stop"
    try:
        score = episode.score(termination)
    except Exception as err:  # a dead or misbehaving environment cannot score: 0, recorded with its kind
        termination, error = "env_error", error or f"{type(err).__name__}: {err}"[:2000]
        score = Score(0.0, False, {"termination": termination, "score_error": f"{type(err).__name__}: {err}"[:2000]})
    finally:
        try:
            episode.close()
        except Exception:  # closing must not turn a recorded episode into a crash
            pass
    reasons = dict(score.reasons)
    if error:
        reasons["error"] = error
        kind = _error_kind(error)
        if kind:
            reasons["error_kind"] = kind
    return Trajectory(task_id=task_id, benchmark=benchmark, trial=trial, model=policy.name, messages=messages,
                      reward=score.reward, passed=score.passed, termination=termination, reasons=reasons,
                      seconds=time.perf_counter() - t0, started_at=started, split=split, **stats)
