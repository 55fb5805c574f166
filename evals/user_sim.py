"""The user simulator, shared by benchmarks: which model plays the user, reached how.

τ²-bench drives its own UserSimulator through litellm (`litellm_user`); a benchmark of your
own can use `SimulatedUser`, which speaks through trace-rl's LLM client."""
from __future__ import annotations

import os

DEFAULT_USER_MODEL = "qwen2.5-coder-0.5b"


def user_config(spec=None):
    """An LLMConfig for the user simulator: given one, a model name string, or the embedded default."""
    from trace_rl.core.llm import LLMConfig

    if spec is None:
        return LLMConfig(model=DEFAULT_USER_MODEL)
    return LLMConfig(model=spec) if isinstance(spec, str) else spec


def user_llm(spec=None):
    """trace-rl's LLM client for the user-simulator model (served locally unless base_url is set)."""
    from trace_rl.core.llm import LLM

    return LLM(user_config(spec))


def litellm_user(spec=None) -> tuple[str, dict]:
    """The user simulator as a litellm model string + args (an OpenAI-compatible endpoint); a plain
    string is taken as a litellm model name as it is."""
    from trace_rl.core.llm import local_endpoint

    if isinstance(spec, str):
        return spec, {"temperature": 0.0}
    cfg = user_config(spec)
    if cfg.base_url:
        base, name = cfg.base_url, cfg.model
    else:
        base, name = local_endpoint(cfg.model, cfg.n_ctx, instance="user-simulator")
    return f"openai/{name}", {"api_base": base, "api_key": cfg.api_key or os.environ.get("OPENAI_API_KEY", "sk-local"),
                              "temperature": cfg.temperature, "max_tokens": cfg.max_tokens}


class SimulatedUser:
    """A user played by an LLM from a scenario text: `reply(conversation)` gives the user's next
    message; the user ends the conversation by writing `stop_token`."""

    def __init__(self, scenario: str, spec=None, stop_token: str = "###STOP###"):
        self.scenario, self.llm, self.stop_token = scenario, user_llm(spec), stop_token

    def reply(self, conversation: list[dict]) -> tuple[str, bool]:
        """(text, done) for the agent-side conversation so far (roles flipped for the model)."""
        flipped = [{"role": "assistant" if m["role"] == "user" else "user", "content": m.get("content") or ""}
                   for m in conversation if m["role"] in ("user", "assistant") and m.get("content")]
        system = (f"You are a customer talking to an agent. Your situation and goal:\n{self.scenario}\n"
                  f"Say one short message at a time. When your goal is met or cannot be met, write {self.stop_token}.")
        text = self.llm.chat([{"role": "system", "content": system}, *flipped]).content or ""
        return text.replace(self.stop_token, "").strip(), self.stop_token in text
