"""The user simulator, shared by benchmarks: which model plays the user, reached how.

τ²-bench drives its own UserSimulator through litellm (`litellm_user`); a benchmark of your
own can play its user with `user_llm`, trace-rl's LLM client for the same model."""
from __future__ import annotations

import os

DEFAULT_USER_MODEL = "qwen2.5-coder-0.5b"


def user_config(spec=None):
    """An LLMConfig for the user simulator: given one, a model name string, or the embedded default."""
    from trace_rl.models.llm import LLMConfig

    if spec is None:
        return LLMConfig(model=DEFAULT_USER_MODEL)
    return LLMConfig(model=spec) if isinstance(spec, str) else spec


def user_llm(spec=None):
    """trace-rl's LLM client for the user-simulator model (served locally unless base_url is set)."""
    from trace_rl.models.llm import LLM

    return LLM(user_config(spec))


def litellm_user(spec=None) -> tuple[str, dict]:
    """The user simulator as a litellm model string + args (an OpenAI-compatible endpoint); a plain
    string is taken as a litellm model name as it is."""
    from trace_rl.models.llm import local_endpoint

    if isinstance(spec, str):
        return spec, {"temperature": 0.0}
    cfg = user_config(spec)
    base, name = (cfg.base_url, cfg.model) if cfg.base_url \
        else local_endpoint(cfg.model, cfg.n_ctx, instance="user-simulator", flash_attn=cfg.flash_attn)
    return f"openai/{name}", {"api_base": base, "api_key": cfg.api_key or os.environ.get("OPENAI_API_KEY", "sk-local"),
                              "temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
