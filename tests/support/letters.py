"""A toy in-process benchmark whose reward varies with the sampled text (share of the letter
'a' in the final reply), so GRPO groups of a random-init model carry signal. It drives the
training code where no trained model or sandbox is wanted: tests and GPU scaling benchmarks."""
from __future__ import annotations

import json

from trace_rl.evals.benchmark import Benchmark, Episode, Observation, Score, Task


class LetterEpisode(Episode):
    """Reward = share of the letter 'a' in the agent's reply: varies with sampled text, so a
    random model's GRPO groups carry signal. A tool call is answered, then the agent replies."""

    tools = [{"type": "function", "function": {"name": "get_user", "description": "Get a user.",
                                               "parameters": {"type": "object", "properties": {
                                                   "user_id": {"type": "string"}}, "required": ["user_id"]}}}]
    max_steps = 3

    def __init__(self, task_id: str, hinted: bool = False):
        self.task_id, self.hinted, self.reply, self.closed = task_id, hinted, "", False
        self.plain_system_prompt = f"Say many a letters. Task {task_id}."
        self.system_prompt = self.plain_system_prompt + ("\n\nHint: the letter a." if hinted else "")

    def reset(self):
        return Observation([{"role": "user", "content": f"Go {self.task_id}"}])

    def step(self, content, tool_calls):
        if tool_calls:
            return Observation([{"role": "tool", "tool_call_id": tc["id"], "content": json.dumps({"city": "Paris"})}
                                for tc in tool_calls])
        self.reply = content
        return Observation([], done=True, reason="agent_stop")

    def score(self, termination):
        r = self.reply.count("a") / max(1, len(self.reply))
        return Score(r, r >= 0.5, {"termination": termination})

    def close(self):
        self.closed = True


class LetterBench(Benchmark):
    name = "letters"

    def splits(self):
        return ["train"]

    def __init__(self, n_tasks: int = 8):
        self.n_tasks = n_tasks
        self.opened: list[LetterEpisode] = []

    def tasks(self, split="train"):
        return [Task(str(i), self.name, split) for i in range(self.n_tasks)]

    def episode(self, task_id, hinted=False):
        ep = LetterEpisode(task_id, hinted)
        self.opened.append(ep)
        return ep
