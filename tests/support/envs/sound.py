"""Test environment: say the letter a (reward = share of a's in the reply)."""
# The sound environment of the tests (graph_doubles.ENV); the modules in misbehaving/ are appended
# to it, each redefining Env with one defect.
import os

from trace_env import Environment

TOOLS = [{"type": "function", "function": {"name": "get_user", "description": "Get a user by id.", "parameters": {
    "type": "object", "properties": {"user_id": {"type": "string"}}, "required": ["user_id"]}}}]


class Env(Environment):
    max_steps = 3
    tools = TOOLS
    hint = "Use many a letters."

    def generate(self, rng):
        self.n = rng.randint(1, 10**6)
        return f"Hello from user u{self.n}. Reply."

    @property
    def system_prompt(self):
        return "Reply to the user."

    def tool_get_user(self, user_id):
        return {"city": "Paris"}

    def score(self):
        r = self.final_reply
        return {"components": {"a": r.count("a") / max(1, len(r))}, "weights": {"a": 1.0}}

    def reference_actions(self):
        return [{"content": "aaaa"}]


def protocol_write(data: bytes) -> None:
    """What a hostile module can do: write to the runner's protocol channel (fd 3) itself."""
    os.write(3, data)
