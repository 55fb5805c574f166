"""Pattern mode (smaller models still): the model only picks one of a few environment shapes and binds the
target's tools to it, decoded under a grammar built per target (agents/env_patterns.py); code expands the
choice into a spec, and the same runtime, checks and verifier judge it.

A choice that failed is not taken again, with one exception: when calibration found the env too easy (too
hard) for the base model, the next round may send the same pattern and tools, and code expands them one
difficulty level harder (easier; env_patterns.HARDER). The level is code's, never the model's; each round
records it (difficulty.json, the manifest)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, Field

from trace_rl import prompts
from trace_rl.agents import env_patterns
from trace_rl.agents.builders import Target, ask_builder
from trace_rl.agents.builders.spec import tool_line
from trace_rl.agents.env_spec import render_module
from trace_rl.core.io import atomic_write_json
from trace_rl.core.records import Capability
from trace_rl.core.rundir import Attempt, read_control

STEPS = {"too_easy": 1, "too_hard": -1}  # calibration's verdict -> the level's change


@dataclass(frozen=True)
class Retry:
    """The previous round's choice, which calibration found too easy or too hard (`verdict`): it may come
    back once more, at `level`."""
    choice: dict
    level: int
    verdict: str

    def offer(self) -> str:
        """What the builder model is told it may do instead of changing pattern or tools."""
        what = env_patterns.HARDER[self.choice["pattern"]].get(self.level, "the pattern as first written")
        harder = "harder" if self.verdict == "too_easy" else "easier"
        return (f"Calibration found that environment {self.verdict.replace('_', ' ')} for the base model. You may "
                f"send the same pattern and tools again: code will make the task {harder} (difficulty {self.level} "
                f"of {len(env_patterns.LEVELS)}: {what}). Or choose another pattern or other tools.")


def binding(choice: dict) -> dict:
    """What decides the env: the pattern and its tools, not the request's words (nor a recorded level)."""
    return {k: v for k, v in choice.items() if k not in ("request", "difficulty")}


def level_of(choice: dict, retry: Retry | None) -> int:
    """The difficulty a choice is expanded at: the retry's level for its binding, else 1."""
    return retry.level if retry is not None and binding(choice) == binding(retry.choice) else 1


class Difficulty(BaseModel):
    """attempt_XX/difficulty.json: the level code expanded the round's choice at, and why."""
    pattern: str = ""
    difficulty: int = Field(ge=min(env_patterns.LEVELS), le=max(env_patterns.LEVELS))
    why: str = ""


def attempt_level(attempt: Attempt) -> int:
    """The level a round's choice was expanded at (1 for a round from before levels existed); a file of
    the wrong shape is a RunDirError naming it and its field."""
    if not attempt.difficulty.is_file():
        return 1
    return read_control(attempt.difficulty, Difficulty, "remove the round's folder to build it again").difficulty


def failed_choices(earlier: list[Attempt]) -> list[dict]:
    """Every earlier round's choice (all of them failed), with the level it was expanded at ("difficulty")."""
    return [{**json.loads(a.builder_choice.read_text()), "difficulty": attempt_level(a)}
            for a in earlier if a.builder_choice.is_file()]


def tried(failed: list[dict]) -> list[tuple[dict, int]]:
    """(binding, level) of each failed choice: neither may come again as it was."""
    return [(binding(c), c.get("difficulty", 1)) for c in failed]


def retry_after(earlier: list[Attempt]) -> Retry | None:
    """The last round's choice one level harder (easier) when its calibration failed as too easy (too
    hard); None for any other outcome, where no level is left that way, or where an earlier round
    already failed with that binding at that level (1 too easy, 2 too hard: not 1 again)."""
    previous = earlier[-1] if earlier else None
    if previous is None or not previous.builder_choice.is_file() or not previous.verifier_report.is_file():
        return None
    report = json.loads(previous.verifier_report.read_text())
    verdict = (report.get("calibration") or {}).get("verdict")
    gated = any(f["check"] == "calibration" and not f["passed"] for f in report.get("findings", []))
    level = attempt_level(previous) + STEPS.get(verdict, 0)
    choice = json.loads(previous.builder_choice.read_text())  # as the model wrote it
    if not gated or verdict not in STEPS or level not in env_patterns.LEVELS or \
            (binding(choice), level) in tried(failed_choices(earlier)):
        return None
    return Retry(choice, level, verdict)


def pattern_messages(capability: Capability, target: Target, feedback: str | None, previous: str | None,
                     patterns: list[str] | None = None, retry: Retry | None = None) -> list[dict]:
    user = (f"# Capability to train\n{capability.name}: {capability.description}\n\n"
            f"# Target benchmark: {target.name}\n## Its tools (name(arguments): description)\n"
            + "\n".join(tool_line(t["function"]) for t in target.tools))
    if previous is not None:  # findings last, nearest the answer
        user += (f"\n\n# Your previous choice\n{previous}\n# What the checks found (fix every one)\n{feedback}\n"
                 + (retry.offer() if retry else
                    "Choose again: another pattern or other tools. Do not send the previous choice unchanged."))
    system = prompts.load("env_builder_pattern", patterns=env_patterns.pattern_menu(target.tools, patterns))
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def write_pattern(llm, capability: Capability, target: Target, feedback=None, previous=None,
                  attempts: int = 3, failed: list[dict] = (), retry: Retry | None = None) -> tuple[dict, dict]:
    """(the builder's choice as it wrote it, the spec code expanded from it, at `level_of(choice, retry)`).
    The choice is decoded under env_patterns.decode_schema (only bindings of the target's tools that
    expand, only patterns that fit the capability: env_patterns.fitting); a choice that does not fit the
    tools (env_patterns.PatternError), or binds the same pattern and tools as a `failed` choice of an
    earlier round at the level it would get now (a failed choice's "difficulty", 1 if absent), goes back
    to the model like a validation error (a choice is a few dozen tokens, so one more try than spec mode
    costs little). Only `retry` gives a failed binding another level."""
    model = env_patterns.choice_model(target.tools)  # a target no pattern fits: a PatternError, this round's
    grammar = env_patterns.fitting(capability, env_patterns.decode_schema(target.tools))
    patterns = env_patterns.offered(grammar)
    done = tried(failed)

    def expanded(choice) -> tuple[dict, dict]:
        if why := env_patterns.misfit(capability, choice.root.pattern, patterns):
            raise env_patterns.PatternError("pattern", why)
        answer = choice.model_dump()
        level = level_of(answer, retry)
        if (binding(answer), level) in done:  # a small model resends a failed choice word for word
            raise env_patterns.PatternError("pattern", "the same pattern and tools as your previous choice, which "
                                                       "failed the checks: choose another pattern or other tools")
        try:
            return answer, env_patterns.expand(choice.root, target.tools, level)
        except (KeyError, TypeError) as err:  # a tool schema code cannot read: the model's to route around
            raise env_patterns.PatternError("write_tool", f"code cannot expand this binding ({err!r}): choose "
                                                          "other tools") from None
    messages = pattern_messages(capability, target, feedback, previous, patterns, retry)
    return ask_builder("pattern choice", lambda: llm.structured(
        messages, model, attempts, check=expanded, decode_schema=grammar, **({"temperature": 0.7} if previous else {})))


def write(llm, capability: Capability, target: Target, examples: list[str], attempt: Attempt, feedback: str | None,
          previous: str | None, earlier: list[Attempt]) -> str:
    """Also writes builder_choice.json (the model's choice), difficulty.json (the level code expanded it at,
    and why) and spec.json (what code expanded it into). Every earlier round's choice failed: none may come
    again at the same level."""
    retry = retry_after(earlier)
    choice, spec = write_pattern(llm, capability, target, feedback, previous, failed=failed_choices(earlier),
                                 retry=retry)
    if retry is not None and binding(choice) == binding(retry.choice):
        level = retry.level
        was = retry.level - STEPS[retry.verdict]
        why = (f"the previous round's env, the same pattern and tools at difficulty {was}, was "
               f"{retry.verdict.replace('_', ' ')} for the base model")
    else:
        level, why = 1, "a pattern and tools start at difficulty 1"
    atomic_write_json(attempt.builder_choice, choice)
    atomic_write_json(attempt.difficulty, {"pattern": choice["pattern"], "difficulty": level, "why": why})
    atomic_write_json(attempt.spec, spec)
    return render_module(spec, target.tools, target.policy)
