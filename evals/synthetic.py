"""A synthesized environment (running in a sandbox session) behind the Episode protocol,
so the base agent, calibration and GRPO roll it out exactly like a real benchmark."""
from __future__ import annotations

from trace_rl.evals.benchmark import Benchmark, Episode, Observation, Score, Task, decode_tool_calls
from trace_rl.sandbox import contract
from trace_rl.sandbox.session import Closing, Sandbox, SessionLimits, SessionPool


def to_env_action(content: str, tool_calls: list[dict]) -> dict:
    """OpenAI assistant turn -> the contract's action."""
    if not tool_calls:
        return {"content": content}
    # a malformed call keeps a non-object marker, which the env reports as a tool error
    return {"tool_calls": [{"id": i, "name": n, "arguments": a if a is not None else "<malformed arguments>"}
                           for i, n, a in decode_tool_calls(tool_calls)]}


class SyntheticEpisode(Episode):
    def __init__(self, session: Sandbox, seed: int, hinted: bool = False):
        self.session, self.seed, self.hinted = session, seed, hinted
        self.system_prompt, self.tools, self.plain_system_prompt = "", [], ""

    def reset(self) -> Observation:
        self.session.new_episode()
        obs = contract.reset(self.session, self.seed)
        self.plain_system_prompt, self.tools, hint = obs["system_prompt"], obs["tools"], obs.get("hint") or ""
        self.system_prompt = self.plain_system_prompt + (f"\n\nHint: {hint}" if self.hinted and hint else "")
        self.max_steps = int(obs.get("max_steps") or self.max_steps)
        return Observation(messages=obs["messages"])

    def step(self, content: str, tool_calls: list[dict]) -> Observation:
        out = contract.step(self.session, to_env_action(content, tool_calls))
        return Observation(messages=out["messages"], done=out["done"], reason="agent_stop" if out["done"] else None)

    def score(self, termination: str) -> Score:
        if termination == "env_error":  # the module broke mid-episode: its reward is not trusted
            return Score(0.0, False, {"termination": termination, "seed": self.seed, "scored": False})
        r = contract.reward(self.session)  # finite, in [0, 1], or a SandboxError (an env_error episode)
        return Score(reward=r["reward"], passed=r["success"],
                     reasons={"components": r["components"], "termination": termination, "seed": self.seed})


class SyntheticBenchmark(Closing, Benchmark):
    """A synthesized environment as a benchmark: task ids are seeds, episodes run in a warm
    sandbox pool. Use as a context manager (it owns containers)."""

    def __init__(self, code: str, name: str = "synthetic", seeds: range = range(100), pool_size: int = 2,
                 hinted: bool = False, limits=None, verified: bool = False, backend: str | None = None):
        """`verified`: the code passed the Docker verifier (then a machine without Docker may run it
        in the subprocess backend: `backend`)."""
        self.name, self.seeds, self.hinted = name, seeds, hinted
        self.pool = SessionPool(code, size=pool_size, limits=limits or SessionLimits(),  # grows with episodes alive
                                verified=verified, backend=backend)

    def splits(self) -> list[str]:
        return ["seeds"]

    def tasks(self, split: str = "seeds"):
        return [Task(str(s), self.name, split) for s in self.seeds]

    def episode(self, task_id: str, hinted: bool | None = None) -> "PooledEpisode":
        return PooledEpisode(self.pool, int(task_id), self.hinted if hinted is None else hinted)

    def close(self) -> None:
        self.pool.close()


class PooledEpisode(SyntheticEpisode):
    """Takes a warm session from the pool at reset and gives it back at close."""

    def __init__(self, pool, seed: int, hinted: bool = False):
        self.pool = pool
        super().__init__(None, seed, hinted)

    def reset(self) -> Observation:
        self.session = self.pool.acquire()
        return super().reset()

    def close(self) -> None:
        if self.session is not None:
            self.pool.release(self.session)
            self.session = None
