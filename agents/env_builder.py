"""Env-builder agent and the synthesis loop: write -> verify -> (findings back) -> rewrite.

The builder LLM gets the capability (name, description, example failed trajectories), the
target's tool schemas, policy and message format, the environment contract and a worked
reference environment, and answers with one Python module. The code is parsed here (never
executed on the host) and then run only inside the sandbox by the verifier. Every attempt
is kept: env.py, verifier_report.json (with calibration figures when run).
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, field_validator

from trace_rl import prompts
from trace_rl.agents.verifier import VerifierReport, VerifyConfig, verify
from trace_rl.core.io import atomic_write_json


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


@dataclass
class Target:
    """What the environment must imitate."""
    name: str
    tools: list[dict]
    policy: str
    system_prompt_format: str  # how the target frames its system prompt


def build_messages(capability: dict, target: Target, examples: list[str], feedback: str | None,
                   previous: str | None) -> list[dict]:
    tools = json.dumps(target.tools, indent=1)
    user = (f"# Capability to train\n{capability['name']}: {capability['description']}\n\n"
            f"# Failed trajectories that show the gap\n" + "\n\n".join(examples)[:6000] +
            f"\n\n# Target benchmark: {target.name}\n## Its tool schemas (copy the ones you use exactly)\n{tools[:12000]}"
            f"\n\n## Its policy (excerpt)\n{target.policy[:4000]}\n\n## Its system prompt format\n"
            f"{target.system_prompt_format[:1500]}")
    if previous is not None:
        user += f"\n\n# Your previous attempt\n```python\n{previous}\n```\n# Verifier findings to fix\n{feedback}"
    system = prompts.load("env_builder", contract=contract_source(), example=reference_example())
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


class BuilderError(ValueError):
    """The builder gave no valid module; `reply` is its last answer, kept for the record."""

    def __init__(self, message: str, reply: str = ""):
        super().__init__(message)
        self.reply = reply


def write_env(llm, capability: dict, target: Target, examples: list[str], feedback=None, previous=None,
              attempts: int = 3) -> EnvDraft:
    msgs = build_messages(capability, target, examples, feedback, previous)
    last, text = "", ""
    for _ in range(attempts):
        try:
            reply = llm.chat(msgs)
        except Exception as err:  # the endpoint failed (timeout, refused): this round fails, on the record
            raise BuilderError(f"the builder's endpoint failed: {type(err).__name__}: {str(err)[:500]}", text) from err
        text = reply.content
        try:
            return parse_draft(text)
        except ValueError as err:
            last = str(err)
            msgs = msgs + [{"role": "assistant", "content": text},
                           {"role": "user", "content": f"That module is not valid: {last}. Send the whole corrected module."}]
    raise BuilderError(f"env-builder produced no valid module after {attempts} tries: {last}", text)


def attempt_dir(out_dir: str | Path, rnd: int) -> Path:
    return Path(out_dir) / f"attempt_{rnd:02d}"


def build_attempt(builder, capability: dict, target: Target, examples: list[str], out_dir: str | Path, rnd: int,
                  feedback: str | None = None, previous: str | None = None) -> dict:
    """Round `rnd` of the builder: attempt_XX/env.py, or attempt_XX/builder_error.json when the
    builder gave no valid module. A round already on disk is returned as it is (resume)."""
    adir = attempt_dir(out_dir, rnd)
    if (adir / "env.py").is_file():
        return {"round": rnd, "env": str(adir / "env.py")}
    if (adir / "builder_error.json").is_file():
        return {"round": rnd, "error": json.loads((adir / "builder_error.json").read_text())["error"]}
    adir.mkdir(parents=True, exist_ok=True)
    try:
        draft = write_env(builder, capability, target, list(examples), feedback, previous)
    except ValueError as err:
        if getattr(err, "reply", ""):
            (adir / "builder_reply.txt").write_text(err.reply)  # what it wrote, for whoever reads the findings
        atomic_write_json(adir / "builder_error.json", {"error": str(err)})
        return {"round": rnd, "error": str(err)}
    tmp = adir / ".env.py.tmp"
    tmp.write_text(draft.code)
    tmp.replace(adir / "env.py")
    return {"round": rnd, "env": str(adir / "env.py")}


def verify_attempt(attempt: dict, capability: dict, target: Target, cfg: VerifyConfig = VerifyConfig(),
                   reviewer=None, base_policy=None) -> dict:
    """Verify one attempt (cached in verifier_report.json); writes the attempt's manifest.json.
    Returns the report as a dict, with `feedback` for the next round."""
    if "env" not in attempt:
        return {"passed": False, "feedback": f"the builder gave no valid module: {attempt['error']}"}
    env = Path(attempt["env"])
    cached = env.parent / "verifier_report.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    code = env.read_text()
    report: VerifierReport = verify(code, target.tools, capability, cfg, reviewer, base_policy)
    out = {**report.to_dict(), "feedback": report.feedback()}
    tools = next((f.figures.get("tools") for f in report.findings if f.check == "tool_schemas"), None)
    atomic_write_json(env.parent / "manifest.json", {
        "capability": capability["name"], "description": capability.get("description", ""), "target": target.name,
        "round": attempt["round"], "tools": tools, "passed": report.passed,
        "sha256": hashlib.sha256(code.encode()).hexdigest(),
        "calibration": {k: v for k, v in (report.calibration or {}).items() if k != "groups"} or None})
    atomic_write_json(cached, out)
    return out


def synthesize(capability: dict, target: Target, builder, out_dir: str | Path, examples: list[str] = (),
               reviewer=None, base_policy=None, cfg: VerifyConfig = VerifyConfig(), max_rounds: int = 5,
               log=print) -> dict:
    """Build and verify until the environment passes or `max_rounds` are spent.

    Returns {"status": "verified" | "needs_human", "rounds": n, "env": path-or-None}."""
    out = Path(out_dir)
    feedback = previous = None
    for rnd in range(1, max_rounds + 1):
        attempt = build_attempt(builder, capability, target, list(examples), out, rnd, feedback, previous)
        report = verify_attempt(attempt, capability, target, cfg, reviewer, base_policy)
        failed = [f["check"] for f in report.get("findings", []) if not f["passed"]] or ["builder"]
        log(f"round {rnd}: {'passed' if report['passed'] else 'failed: ' + ', '.join(failed)}")
        if report["passed"]:
            result = {"status": "verified", "rounds": rnd, "env": attempt["env"]}
            atomic_write_json(out / "result.json", result)
            return result
        feedback = report["feedback"]
        previous = Path(attempt["env"]).read_text() if "env" in attempt else previous
    result = {"status": "needs_human", "rounds": max_rounds, "env": None, "last_findings": feedback}
    atomic_write_json(out / "result.json", result)
    return result


def library() -> dict[str, Path]:
    """Hand-written, verified environments shipped with trace-rl: {module name: path}.
    Named `<capability>_<target domain>.py`; a human (or an unattended run that allows it)
    can use one when the builder's attempts for that capability all fail."""
    root = resources.files("trace_rl.sandbox") / "envs"
    return {p.name[:-3]: Path(str(p)) for p in root.iterdir() if p.name.endswith(".py")}


STOP_WORDS = frozenset("""a an and any are as at be before by can do does for from has have in into is it its
it's not of on or that the their them then this to use uses using when which with without agent agents user users
capability task tasks tool tools call calls calling environment reference right one two""".split())
LIBRARY_ALIASES: dict[str, str] = {  # discovered names that mean a library capability, by a person's reading
    "argument_precision": "tool_call_precision", "exact_tool_arguments": "tool_call_precision",
    "tool_argument_precision": "tool_call_precision", "schema_adherence": "tool_call_precision",
    "precondition_checking": "precondition_verification", "policy_precondition_checking": "precondition_verification",
    "eligibility_verification": "precondition_verification", "stateful_diagnosis": "mobile_data_troubleshooting",
    "diagnose_before_acting": "mobile_data_troubleshooting",
}


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower().replace("_", " ")) if len(w) > 2 and w not in STOP_WORDS}


def library_match(capability: dict, target: str, min_shared: int = 4, min_share: float = 0.25) -> dict | None:
    """The library environment for `target` (e.g. tau2:telecom) that trains this capability, or None.

    A match is the library capability's own name, an alias of it (LIBRARY_ALIASES), or at least
    `min_shared` content words (no stop words), and `min_share` of the capability's, shared with
    its name and docstring. Returns {"path", "name", "description", "why"}; the adapter is then named
    and described after the library capability, not the discovered one."""
    domain = target.split(":")[-1].split("@")[0]  # tau2:airline@tau3 -> airline
    name = capability["name"]
    words = content_words(name + " " + capability.get("description", ""))
    best = None
    for module, path in sorted(library().items()):
        if not module.endswith("_" + domain):
            continue
        lib_name = module[: -len(domain) - 1]
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        entry = {"path": path, "name": lib_name, "description": " ".join(doc.split("\n\n")[0].split())}
        if name == lib_name or LIBRARY_ALIASES.get(name) == lib_name:
            return {**entry, "why": "same capability" if name == lib_name else f"alias of {lib_name}"}
        shared = words & content_words(lib_name + " " + doc)
        if len(shared) >= min_shared and len(shared) >= min_share * len(words) and \
                (best is None or len(shared) > len(best["shared"])):
            best = {**entry, "shared": shared}
    if best is None:
        return None
    shared = sorted(best.pop("shared"))
    return {**best, "why": f"shares {len(shared)} content words: {', '.join(shared)}"}
