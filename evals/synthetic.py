"""A synthesized environment (running in a sandbox session) behind the Episode protocol,
so the base agent, calibration and GRPO roll it out exactly like a real benchmark."""
from __future__ import annotations

import json

from trace_rl.evals.benchmark import Episode, Observation, Score
from trace_rl.sandbox.session import EnvSession


def to_env_action(content: str, tool_calls: list[dict]) -> dict:
    """OpenAI assistant turn -> the contract's action."""
    if not tool_calls:
        return {"content": content}
    calls = []
    for tc in tool_calls:
        fn = tc["function"]
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = {"__malformed__": fn.get("arguments")}
        calls.append({"id": tc.get("id", ""), "name": fn["name"], "arguments": args})
    return {"tool_calls": calls}


class SyntheticEpisode(Episode):
    def __init__(self, session: EnvSession, seed: int, hinted: bool = False):
        self.session, self.seed, self.hinted = session, seed, hinted
        self.system_prompt, self.tools, self.plain_system_prompt = "", [], ""

    def reset(self) -> Observation:
        self.session.new_episode()
        obs = self.session.call("reset", self.seed)
        self.plain_system_prompt = obs["system_prompt"]
        hint = obs.get("hint") or ""
        self.system_prompt = self.plain_system_prompt + (f"\n\nHint: {hint}" if self.hinted and hint else "")
        self.tools = obs["tools"]
        self.max_steps = int(obs.get("max_steps") or self.max_steps)
        return Observation(messages=obs["messages"])

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        out = self.session.call("step", to_env_action(content, tool_calls))
        return Observation(messages=out["messages"], done=out["done"], reason="agent_stop" if out["done"] else None)

    def score(self, termination: str) -> Score:
        r = self.session.call("reward")
        return Score(reward=float(r["reward"]), passed=bool(r["success"]),
                     reasons={"components": r["components"], "termination": termination, "seed": self.seed})
