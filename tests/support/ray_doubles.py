"""Doubles for the Ray executor's tests (tests/evals/test_executor.py) and benchmarks/ray_rollouts.py: importable
by name on every simulated node (conftest puts tests/support on PYTHONPATH, which the nodes inherit), so a
policy or benchmark pickled here is found there."""
from __future__ import annotations

import os
import re
import time

from letters import LetterBench, LetterEpisode
from trace_rl.models.chat import ToolCall
from trace_rl.models.scripted import ScriptedLLM


def letters_script(messages, tools):
    """Deterministic: look the user up, then answer with as many a's as the task number (reward n/8)."""
    if messages[-1]["role"] == "user":
        return ToolCall("get_user", {"user_id": "u1"})
    n = int(re.search(r"Task (\d+)", messages[0]["content"]).group(1))
    return "a" * (n % 9) + "b" * (8 - n % 9)


def city_script(messages, tools):
    """The docs' city.py example (docs/benchmarks.md): a right answer for even users, a wrong one for odd."""
    if messages[-1]["role"] == "tool":
        city = messages[-1]["content"].split('"city": "')[1].split('"')[0]
        uid = int(re.search(r"does u(\d+) live", messages[1]["content"]).group(1))
        return f"They live in {city if uid % 2 == 0 else 'Atlantis'}"
    uid = re.search(r"does (\S+) live", messages[-1]["content"]).group(1)
    return ToolCall("get_user", {"user_id": uid})


def letters_agent() -> ScriptedLLM:
    return ScriptedLLM(letters_script, name="scripted-letters")


class SlowEpisode(LetterEpisode):
    """A letters episode whose every step takes `delay` seconds; its start and end are logged with the node
    that played it (a test sees where an episode was in flight when its node went away). While the file `hold`
    exists no step ends, so a test can take a node away while its episode is surely still in flight."""

    def __init__(self, task_id, delay, log, hold=None):
        super().__init__(task_id)
        self.delay, self.log, self.hold = delay, log, hold

    def _note(self, what):
        if self.log:
            import ray

            with open(self.log, "a") as f:
                f.write(f"{what} {self.task_id} {ray.get_runtime_context().get_node_id()} {os.getpid()}\n")

    def reset(self):
        self._note("start")
        return super().reset()

    def step(self, content, tool_calls):
        time.sleep(self.delay)
        while self.hold and os.path.exists(self.hold):
            time.sleep(0.02)
        return super().step(content, tool_calls)

    def score(self, termination):
        self._note("end")
        return super().score(termination)


class SlowLetters(LetterBench):
    name = "slow-letters"

    def __init__(self, n_tasks=8, delay=0.0, log=None, hold=None):
        super().__init__(n_tasks)
        self.delay, self.log, self.hold = delay, log, hold

    def episode(self, task_id, hinted=False):
        return SlowEpisode(task_id, self.delay, self.log, self.hold)
