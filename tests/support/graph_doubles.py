"""Components for pipeline tests (RunConfig.components = "graph_doubles:components"): a tiny
target benchmark, scripted LLMs (agent, analyst, builder, reviewer) and tiny transformers
models. Each scripted call is appended to $TRACE_RL_CALL_LOG so tests can count work done."""
from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

from doubles import ScriptedLLM, labels_answer
from tiny import tiny_model, tiny_tokenizer
from trace_rl.models.chat import Reply, ToolCall
from trace_rl.evals.benchmark import Benchmark, Episode, Observation, Score, Task, register

CITIES = {f"u{i}": c for i, c in enumerate(["Paris", "Lima", "Oslo", "Rome", "Kyiv", "Baku", "Doha", "Riga"])}
TOOL = {"type": "function", "function": {"name": "get_user", "description": "Get a user by id.", "parameters": {
    "type": "object", "properties": {"user_id": {"type": "string"}}, "required": ["user_id"]}}}


class CityEpisode(Episode):
    system_prompt = "Answer with the user's city. Use the tools."
    tools = [TOOL]
    max_steps = 4

    def __init__(self, user_id):
        self.user_id, self.answer = user_id, ""

    def reset(self):
        return Observation([{"role": "user", "content": f"Which city does {self.user_id} live in?"}])

    def step(self, content, tool_calls):
        if not tool_calls:
            self.answer = content
            return Observation([], done=True, reason="agent_stop")
        return Observation([{"role": "tool", "tool_call_id": tc["id"], "content": json.dumps(
            {"city": CITIES.get(json.loads(tc["function"]["arguments"] or "{}").get("user_id"), "unknown")})}
            for tc in tool_calls])

    def score(self, termination):
        ok = CITIES[self.user_id].lower() in self.answer.lower()
        return Score(float(ok), ok, {"termination": termination})


class CityBench(Benchmark):
    name = "cities"

    def splits(self):
        return ["train", "test"]

    def tasks(self, split):
        ids = sorted(CITIES)
        return [Task(u, self.name, split) for u in (ids[:6] if split == "train" else ids[6:])]

    def episode(self, task_id, **_):
        return CityEpisode(task_id)


register("cities", lambda variant, **kw: CityBench())

ENV = (Path(__file__).parent / "envs" / "sound.py").read_text()  # one sound env for every test
BROKEN_ENV = ENV.replace('return {"components": {"a": r.count("a") / max(1, len(r))}, "weights": {"a": 1.0}}',
                         'return {"components": {"a": 1.0}, "weights": {"a": 1.0}}')


def _log(role: str) -> None:
    path = os.environ.get("TRACE_RL_CALL_LOG")
    if path:
        with open(path, "a") as f:
            f.write(role + "\n")


def agent_script(messages, tools):
    """Even users: look up, then answer right. Odd users: answer without looking (fails)."""
    _log("agent")
    uid = re.search(r"u\d+", messages[1]["content"]).group(0)
    if int(uid[1:]) % 2:
        return "I think it is London."
    if messages[-1]["role"] == "tool":
        return f"The city is {json.loads(messages[-1]['content'])['city']}."
    return ToolCall("get_user", {"user_id": uid})


def analyst_script(messages, tools):
    _log("analyst")
    text = messages[1]["content"]
    trajs = re.findall(r"### trajectory (\S+)\noutcome: (PASSED|FAILED)", text)
    if "Propose at most" in messages[0]["content"]:
        failed = [k for k, o in trajs if o == "FAILED"][:2]
        return json.dumps({"capabilities": [
            {"name": "lookup_before_answering", "description": "Looks facts up with the tools before answering. "
             "Without it the agent guesses.", "example_task_ids": failed},
            {"name": "polite_reply_style", "description": "Replies in full sentences. It is shown everywhere.",
             "example_task_ids": failed}]})
    weak = os.environ.get("TRACE_RL_WEAK_ANALYST")  # labels everything PRESENT, as the embedded 0.5B did for real
    return labels_answer([
        {"trajectory": k, "capability": c, "step": 1, "quote": "Which city does",  # the user's question
         "label": "PRESENT" if weak or c == "polite_reply_style" or o == "PASSED" else "LACKING"}
        for k, o in trajs for c in ("lookup_before_answering", "polite_reply_style")])


def builder_script():
    """First answer breaks the reward (always 1), the second is sound: one verify → build loop."""
    answers = iter([f"```python\n{BROKEN_ENV}```", f"```python\n{ENV}```"])

    def script(messages, tools):
        _log("builder")
        previous = any("Your previous attempt" in m.get("content", "") for m in messages)
        return f"```python\n{ENV}```" if previous else next(answers)
    return script


def reviewer_script(messages, tools):
    _log("reviewer")
    return json.dumps({"verdict": "pass", "findings": []})


def kill_at(node: str) -> None:
    """Fault injection for the resume tests: SIGKILL after node $TRACE_RL_KILL_AT did its work,
    before its checkpoint is written."""
    if os.environ.get("TRACE_RL_KILL_AT") == node:
        os.kill(os.getpid(), signal.SIGKILL)


def components(cfg):
    from trace_rl.graph.pipeline import Components

    def load_base():
        tok = tiny_tokenizer()
        return tiny_model(tok, seed=0), tok

    return Components(benchmark=CityBench(), agent=ScriptedLLM(agent_script, name="scripted-agent"),
                      analyst=ScriptedLLM(analyst_script, name="scripted-analyst"),
                      builder=ScriptedLLM(builder_script(), name="scripted-builder"),
                      reviewer=ScriptedLLM(reviewer_script, name="scripted-reviewer"), calibration=None,
                      load_base=load_base, after_node=kill_at)


def config(**over):
    """A small run of the real pipeline on the doubles above."""
    from trace_rl.graph.config import load_config

    base = {"benchmark": "cities", "components": "graph_doubles:components", "calibrate": False, "builder_mode": "code",
            "analysis": {"n_candidates": 2, "n_runs": 3, "k": 2, "concurrency": 1},
            "verify": {"seeds": 6, "determinism_seeds": 1}, "build_rounds": 3, "max_capabilities": 2,
            "grpo": {"group_size": 2, "groups_per_step": 1, "steps": 2, "max_steps": 2, "max_turn_tokens": 8,
                     "max_seq_len": 1024, "save_steps": 1, "learning_rate": 1e-3},
            "train_seeds": 8, "heldout_seeds": 2, "compose": {"epochs": 1}, "auto_approve": True}
    for k, v in over.items():
        base[k] = v
    return load_config(overrides=base)
