"""What a benchmark declares about its conversation reaches the model: no system prompt means no system
message, and text tool calls turned off means JSON in an answer stays an answer."""
import json

from trace_rl.agents.base_agent import run_episode
from trace_rl.core.episode import Episode, Observation, Score
from trace_rl.models.chat import parse_tool_calls
from trace_rl.models.scripted import ScriptedLLM

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "d",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
AS_TEXT = '{"name": "lookup", "arguments": {"q": "paris"}}'


class Lookup(Episode):
    """Passes when the agent calls `lookup` (in any form the loop accepts), then answers."""
    tools, max_steps = TOOLS, 3

    def __init__(self, system_prompt="Use the tools.", text_tool_calls=True):
        self.system_prompt, self.text_tool_calls, self.called = system_prompt, text_tool_calls, False

    def reset(self):
        return Observation([{"role": "user", "content": "Where?"}])

    def step(self, content, tool_calls):
        if tool_calls:
            self.called = True
            return Observation([{"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "found"}])
        return Observation([], done=True, reason="agent_stop")

    def score(self, termination):
        return Score(float(self.called), self.called)


def play(episode, script):
    llm = ScriptedLLM(list(script))
    return llm, run_episode(llm, episode, task_id="t", benchmark="b")


def test_a_benchmark_without_a_system_prompt_sends_no_system_message():
    llm, traj = play(Lookup(system_prompt=None), ["Paris"])
    assert llm.requests[0][0] == {"role": "user", "content": "Where?"}
    assert [m["role"] for m in traj.messages] == ["user", "assistant"]
    _, with_prompt = play(Lookup(system_prompt=""), ["Paris"])  # "" is a prompt: an empty system message
    assert with_prompt.messages[0] == {"role": "system", "content": ""}


def test_text_tool_calls_count_unless_the_benchmark_turns_them_off():
    _, recovered = play(Lookup(), [AS_TEXT, "Paris"])
    assert recovered.passed and recovered.text_tool_calls == 1
    _, strict = play(Lookup(text_tool_calls=False), [AS_TEXT, "Paris"])
    assert not strict.passed and strict.text_tool_calls == 0 and strict.tool_calls == 0
    assert json.loads(strict.messages[-1]["content"])["name"] == "lookup"  # the JSON stayed the answer


def test_off_keeps_the_chat_templates_own_tags():
    tagged = f"<tool_call>\n{AS_TEXT}\n</tool_call>"
    assert [c.name for c in parse_tool_calls(tagged, {"lookup"}, loose=False)] == ["lookup"]
    assert parse_tool_calls(AS_TEXT, {"lookup"}, loose=False) == []
    assert parse_tool_calls(f"```json\n{AS_TEXT}\n```", {"lookup"}, loose=False) == []
    assert [c.name for c in parse_tool_calls(AS_TEXT, {"lookup"})] == ["lookup"]
