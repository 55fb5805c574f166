"""The env-builder's modes, one file each: `code` (the model writes a Python module), `spec` (a JSON spec
decoded under a grammar, run by the sandbox's spec runtime) and `pattern` (the model picks one of a few env
shapes and binds the target's tools; code writes the spec). Each is a `Builder`: it asks the model, writes
what the model gave and what code made of it into the round's folder, and returns the env module's text.
The loop that runs them (verify, findings back, rounds) is agents/env_builder.py."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from trace_rl.core.records import Capability
from trace_rl.core.rundir import Attempt
from trace_rl.models.chat import ReplyError, StructuredOutputError


@dataclass
class Target:
    """What the environment must imitate."""
    name: str
    tools: list[dict]
    policy: str
    system_prompt_format: str  # how the target frames its system prompt

    @classmethod
    def of(cls, benchmark) -> "Target":
        spec = benchmark.spec()
        return cls(benchmark.name, spec["tools"], spec["policy"], spec["system_prompt"])


class Builder(Protocol):
    def __call__(self, llm, capability: Capability, target: Target, examples: list[str], attempt: Attempt,
                 feedback: str | None, previous: str | None, earlier: list[Attempt]) -> str:
        """Round `attempt`'s env module (its other files written into `attempt`); `feedback` and `previous`:
        the last round's findings and what the model wrote then; `earlier`: every earlier round. Raises
        ValueError (a BuilderError, with the model's last reply) when the model gave nothing usable."""


class BuilderError(ReplyError, ValueError):
    """The builder gave no valid module or spec."""


def ask_builder(what: str, ask: Callable):
    """`ask()`, with every way it fails as a BuilderError: no valid `what` (the last answer kept),
    or an endpoint that failed (timeout, refused): either way this round fails, on the record."""
    try:
        return ask()
    except StructuredOutputError as err:
        raise BuilderError(f"env-builder produced no valid {what}: {err}", err.reply) from None
    except Exception as err:
        raise BuilderError(f"the builder's endpoint failed: {type(err).__name__}: {str(err)[:500]}") from err
