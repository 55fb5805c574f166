"""Code mode: the model writes the whole environment module. It gets the capability (name, description,
example failed trajectories), the target's tool schemas, policy and message format, the environment
contract and a worked reference environment. The module is parsed here (never executed on the host) and
runs only inside the sandbox."""
from __future__ import annotations

import ast
import json
import re
from importlib import resources

from pydantic import BaseModel, field_validator

from trace_rl import prompts
from trace_rl.agents.builders import Target, ask_builder
from trace_rl.core.records import Capability
from trace_rl.core.rundir import Attempt


class EnvDraft(BaseModel):
    code: str

    @field_validator("code")
    @classmethod
    def _valid_module(cls, code: str) -> str:
        try:
            tree = ast.parse(code)  # parsing only; the code runs nowhere but the sandbox
        except SyntaxError as err:
            raise ValueError(f"the code does not parse: line {err.lineno}: {err.msg}") from None
        if not any(isinstance(n, ast.ClassDef) and n.name == "Env" for n in tree.body):
            raise ValueError("the module must define `class Env(Environment)` at top level")
        banned = {"tau2", "requests", "socket", "subprocess"}
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                if name.split(".")[0] in banned:
                    raise ValueError(f"do not import {name}: the environment must be standalone (stdlib only)")
        return code


_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def parse_draft(text: str) -> EnvDraft:
    blocks = _FENCE.findall(text)
    code = max(blocks, key=len) if blocks else text
    return EnvDraft(code=code.strip() + "\n")


def reference_example() -> str:
    return (resources.files("trace_rl.sandbox") / "envs" / "precondition_verification_airline.py").read_text()


def contract_source() -> str:
    return (resources.files("trace_rl.sandbox") / "image" / "trace_env.py").read_text()


def build_messages(capability: Capability, target: Target, examples: list[str], feedback: str | None,
                   previous: str | None) -> list[dict]:
    tools = json.dumps(target.tools, indent=1)
    user = (f"# Capability to train\n{capability.name}: {capability.description}\n\n"
            f"# Failed trajectories that show the gap\n" + "\n\n".join(examples)[:6000] +
            f"\n\n# Target benchmark: {target.name}\n## Its tool schemas (copy the ones you use exactly)\n{tools[:12000]}"
            f"\n\n## Its policy (excerpt)\n{target.policy[:4000]}\n\n## Its system prompt format\n"
            f"{target.system_prompt_format[:1500]}")
    if previous is not None:
        user += f"\n\n# Your previous attempt\n```python\n{previous}\n```\n# Verifier findings to fix\n{feedback}"
    system = prompts.load("env_builder", contract=contract_source(), example=reference_example())
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def write_env(llm, capability: Capability, target: Target, examples: list[str], feedback=None, previous=None,
              attempts: int = 3) -> EnvDraft:
    return ask_builder("module", lambda: llm.ask(build_messages(capability, target, examples, feedback, previous),
                                                 parse_draft, attempts, "Send the whole corrected module."))


def write(llm, capability: Capability, target: Target, examples: list[str], attempt: Attempt, feedback: str | None,
          previous: str | None, earlier: list[Attempt]) -> str:
    return write_env(llm, capability, target, list(examples), feedback, previous).code
