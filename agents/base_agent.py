"""The base agent: a tool-calling loop against any benchmark episode.

Every way an episode can end is an explicit `termination` in the trajectory
(agent_stop, user_stop, max_steps, context_length, llm_error, env_error, env_timeout, ...), never a crash.
"""
from __future__ import annotations

import re
import time
from typing import Any, Callable, Protocol

from trace_rl.core.episode import STEP_TIMEOUT_S, Episode, EpisodeFault, Guarded, Score, opening
from trace_rl.models.chat import is_context_length_error
from trace_rl.core.trajectory import Trajectory


class Policy(Protocol):
    """What the loop needs from a model: `LLM` (any endpoint) or a local transformers policy."""

    name: str

    def chat(self, messages: list[dict], tools: list[dict] | None = None, **kw) -> Any: ...


def _error(err: Exception) -> dict:
    """An exception as a trajectory's reasons: its text, and the sandbox's error kind ("[timeout] ...")
    when it came from a session."""
    text = f"{type(err).__name__}: {err}"[:2000]
    m = re.search(r"\[(timeout|crashed|oom|protocol|output_limit|env_error|episode_timeout|contract)\]", text)
    return {"error": text, **({"error_kind": m.group(1)} if m else {})}


def run_episode(policy: Policy, episode: Episode | Callable[[], Episode], *, task_id: str, benchmark: str, trial: int = 0,
                split: str = "", max_steps: int | None = None, step_timeout_s: float = STEP_TIMEOUT_S,
                **chat_kw) -> Trajectory:
    """Roll out one episode to the end and score it. The episode is played behind the plugin boundary
    (`Guarded`): whatever it raises, returns or hangs on ends the episode as a recorded termination."""
    t0, started = time.perf_counter(), time.time()
    episode = episode if isinstance(episode, Guarded) else Guarded(episode, step_timeout_s)
    stats = dict(steps=0, tool_calls=0, malformed_tool_calls=0, text_tool_calls=0, prompt_tokens=0, completion_tokens=0)
    messages, termination, error = [], None, None  # error: the reasons of the exception that ended the episode
    try:
        obs = episode.reset()
    except EpisodeFault as err:  # e.g. the user simulator failed on its first turn: no messages, nothing to score
        termination, error = err.termination, _error(err)
    else:
        messages = opening(episode.system_prompt, obs.messages)
        if not episode.text_tool_calls:  # the benchmark counts only the model's own call format
            chat_kw = {**chat_kw, "text_tool_calls": False}
        termination = obs.reason if obs.done else None
        max_steps = max_steps or episode.max_steps  # a worker episode learns its limit in reset()
    while termination is None:
        if stats["steps"] >= max_steps:
            termination = "max_steps"
            break
        try:
            reply = policy.chat(messages, tools=episode.tools, **chat_kw)
        except Exception as err:  # endpoint failures end the episode, recorded
            termination, error = "context_length" if is_context_length_error(err) else "llm_error", _error(err)
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
        except EpisodeFault as err:  # the environment or its user simulator failed: recorded, not raised
            termination, error = err.termination, _error(err)
            break
        messages.extend(obs.messages)
        if obs.done:
            termination = obs.reason or "agent_stop"
    try:  # a hung episode is not asked again: its state is unknown and its score would wait as long
        score = episode.score(termination) if messages and termination != "env_timeout" else Score(0.0, False)
    except EpisodeFault as err:  # a dead or misbehaving environment cannot score: 0, recorded with its kind
        termination, error = (termination if error else err.termination), error or _error(err)
        score = Score(0.0, False, {"termination": termination, "score_error": _error(err)["error"]})
    finally:
        episode.close()  # bounded, never raises
    return Trajectory(task_id=task_id, benchmark=benchmark, trial=trial, model=policy.name, messages=messages,
                      reward=score.reward, passed=score.passed, termination=termination,
                      reasons={**score.reasons, **(error or {})}, seconds=time.perf_counter() - t0, started_at=started,
                      split=split, **stats)
