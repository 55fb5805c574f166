"""Pattern mode (smaller models still): the model only picks one of a few environment shapes and binds the
target's tools to it, decoded under a grammar built per target (agents/env_patterns.py); code expands the
choice into a spec, and the same runtime, checks and verifier judge it."""
from __future__ import annotations

import json

from trace_rl import prompts
from trace_rl.agents import env_patterns
from trace_rl.agents.builders import Target, ask_builder
from trace_rl.agents.builders.spec import tool_line
from trace_rl.agents.env_spec import render_module
from trace_rl.core.io import atomic_write_json
from trace_rl.core.records import Capability
from trace_rl.core.rundir import Attempt


def pattern_messages(capability: Capability, target: Target, feedback: str | None, previous: str | None,
                     patterns: list[str] | None = None) -> list[dict]:
    user = (f"# Capability to train\n{capability.name}: {capability.description}\n\n"
            f"# Target benchmark: {target.name}\n## Its tools (name(arguments): description)\n"
            + "\n".join(tool_line(t["function"]) for t in target.tools))
    if previous is not None:  # findings last, nearest the answer
        user += (f"\n\n# Your previous choice\n{previous}\n# What the checks found (fix every one)\n{feedback}"
                 "\nChoose again: another pattern or other tools. Do not send the previous choice unchanged.")
    system = prompts.load("env_builder_pattern", patterns=env_patterns.pattern_menu(target.tools, patterns))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def write_pattern(llm, capability: Capability, target: Target, feedback=None, previous=None,
                  attempts: int = 3, failed: list[dict] = ()) -> tuple[dict, dict]:
    """(the builder's choice as it wrote it, the spec code expanded from it). The choice is decoded
    under env_patterns.decode_schema (only bindings of the target's tools that expand, only patterns that fit
    the capability: env_patterns.fitting); a choice that does not fit the tools (env_patterns.PatternError),
    or binds the same pattern and tools as a `failed` choice of an earlier round, goes back to the model
    like a validation error (a choice is a few dozen tokens, so one more try than spec mode costs little)."""
    model = env_patterns.choice_model(target.tools)  # a target no pattern fits: a PatternError, this round's
    grammar = env_patterns.fitting(capability, env_patterns.decode_schema(target.tools))
    patterns = env_patterns.offered(grammar)
    binding = lambda c: {k: v for k, v in c.items() if k != "request"}  # noqa: E731 - the env, not its wording
    tried = [binding(c) for c in failed]

    def expanded(choice) -> tuple[dict, dict]:
        if why := env_patterns.misfit(capability, choice.root.pattern, patterns):
            raise env_patterns.PatternError("pattern", why)
        if binding(choice.model_dump()) in tried:  # a small model resends a failed choice word for word
            raise env_patterns.PatternError("pattern", "the same pattern and tools as your previous choice, which "
                                                       "failed the checks: choose another pattern or other tools")
        try:
            return choice.model_dump(), env_patterns.expand(choice.root, target.tools)
        except (KeyError, TypeError) as err:  # a tool schema code cannot read: the model's to route around
            raise env_patterns.PatternError("write_tool", f"code cannot expand this binding ({err!r}): choose "
                                                          "other tools") from None
    messages = pattern_messages(capability, target, feedback, previous, patterns)
    return ask_builder("pattern choice", lambda: llm.structured(
        messages, model, attempts, check=expanded, decode_schema=grammar, **({"temperature": 0.7} if previous else {})))


def write(llm, capability: Capability, target: Target, examples: list[str], attempt: Attempt, feedback: str | None,
          previous: str | None, earlier: list[Attempt]) -> str:
    """Also writes builder_choice.json (the model's choice) and spec.json (what code expanded it into). Every
    earlier round's choice failed: none may come again."""
    failed = [json.loads(a.builder_choice.read_text()) for a in earlier if a.builder_choice.is_file()]
    choice, spec = write_pattern(llm, capability, target, feedback, previous, failed=failed)
    atomic_write_json(attempt.builder_choice, choice)
    atomic_write_json(attempt.spec, spec)
    return render_module(spec, target.tools, target.policy)
