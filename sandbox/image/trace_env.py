"""The trace-rl environment contract (stdlib only: it runs inside the sandbox image).

A training environment is one module defining `class Env(Environment)`. It keeps the
target benchmark's tool names, argument types, return JSON shapes and message format,
implements only the few tools its capability needs on a small seeded in-memory state,
and scores episodes algorithmically (no LLM judge).

    env.reset(seed) -> {"system_prompt", "tools", "messages", "hint", "max_steps"}
    env.step(action) -> {"messages", "done"}      action: {"content": str} (reply to the user)
                                                   or {"tool_calls": [{"id", "name", "arguments"}]}
    env.reward()     -> {"reward" in [0, 1], "components": {name: value}, "success": bool}
    env.solve()      -> [action, ...]              reference solution, for validation only

Subclasses implement `generate(rng)` (build the instance, return the first user message),
`system_prompt`, `tools`, one `tool_<name>(**arguments)` method per tool, and `score()`.
"""
import json
import random

from reward import aggregate, SUCCESS_THRESHOLD  # core/reward.py, shipped next to this file


class Environment:
    max_steps = 12
    hint = ""  # soft guidance appended to the system prompt for hinted rollouts (never the answer)
    tools = []  # OpenAI function-tool schemas, identical to the target's

    # -- to implement
    def generate(self, rng):
        """Build the seeded instance; return the user's first message (str)."""
        raise NotImplementedError

    @property
    def system_prompt(self):
        raise NotImplementedError

    def score(self):
        """-> {"components": {name: value in [0, 1]}, "weights": {name: weight}}"""
        raise NotImplementedError

    def reference_actions(self):
        """The reference solver's actions for the current instance."""
        raise NotImplementedError

    # -- provided
    def reset(self, seed):
        self.seed = int(seed)
        self.rng = random.Random(self.seed)
        self.calls = []  # (name, arguments, result) in order
        self.replies = []  # texts sent to the user
        self.steps = 0
        self.done = False
        first = self.generate(self.rng)
        return {"system_prompt": self.system_prompt, "tools": self.tools,
                "messages": [{"role": "user", "content": first}], "hint": self.hint, "max_steps": self.max_steps}

    def step(self, action):
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.steps += 1
        out = []
        calls = action.get("tool_calls") or []
        if calls:
            known = {t["function"]["name"] for t in self.tools}
            for call in calls:
                name, args = call.get("name"), call.get("arguments") or {}
                try:
                    if name not in known:
                        raise ValueError(f"Tool '{name}' not found.")
                    if not isinstance(args, dict):
                        raise ValueError("arguments must be a JSON object")
                    result = getattr(self, "tool_" + name)(**args)
                    content = result if isinstance(result, str) else json.dumps(result)  # tau2: text as is
                except Exception as e:  # tau2 returns tool errors as text, so do we
                    result, content = None, f"Error: {e}"
                self.calls.append((name, args, result))
                out.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": content})
        else:
            self.replies.append(str(action.get("content") or ""))
            self.done = True  # one reply to the user ends the task
        if self.steps >= self.max_steps:
            self.done = True
        return {"messages": out, "done": self.done}

    def reward(self):
        s = self.score()
        comps = s["components"]
        value = aggregate(comps, s["weights"])  # a component outside [0, 1] or a bad weight: ValueError
        return {"reward": value, "components": comps, "success": value >= SUCCESS_THRESHOLD}

    def solve(self):
        return self.reference_actions()

    # -- helpers for subclasses
    def called(self, name, **match):
        """Calls of tool `name` whose arguments include `match`."""
        return [c for c in self.calls if c[0] == name and all(c[1].get(k) == v for k, v in match.items())]

    @property
    def final_reply(self):
        return self.replies[-1] if self.replies else ""
